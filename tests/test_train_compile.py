"""train.compile: the compiled blocks compute what eager does, and pack rows of new lengths do
not recompile once dynamo has marked the sizes dynamic (inductor on the CPU)."""
import copy

import pytest
import torch

from west.models.speech_llm import SpeechLLM
from west.train.compile import compilations, compile_regions

from helpers.speech import make_sample, packed_batch, padded_batch, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batches():
    g = torch.Generator().manual_seed(3)

    def sample(frames, answer):
        feats = torch.randn(frames, 80, generator=g)
        return make_sample([("text", [5, 6]), ("speech", feats), ("answer", list(range(7, 7 + answer)))])

    out = []
    sizes = [[(60, 3), (90, 5)], [(44, 2), (130, 4), (70, 6)], [(100, 3)], "padded", [(52, 5), (61, 2), (75, 3), (88, 4)],
             [(47, 2), (66, 3), (99, 5), (58, 2), (71, 4)], [(83, 6), (120, 2)]]
    for i, utts in enumerate(sizes):
        if utts == "padded":
            out.append(padded_batch([sample(80, 4), sample(57, 2)]))
            continue
        ss = [sample(f, a) for f, a in utts]
        out.append(packed_batch(ss, sum(len(s.ids) for s in ss) + 3 + i))
    return out


def _run(model, batches):
    losses, grads = [], []
    for b in batches:
        model.zero_grad(set_to_none=True)
        out = model(b)
        out["loss_sum"].backward()
        losses.append(float(out["loss_sum"].detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return losses, grads


def test_compiled_blocks_match_eager_and_stop_recompiling():
    """Several attention length groups in the Conformer (the CPU default), the first LLM layer
    checkpointed and the second not (``model.llm.checkpoint_layers: 1``, as on a GPU)."""
    from west.models.llm import hf_checkpointing

    torch.manual_seed(0)
    eager = SpeechLLM(tiny_config()).train()
    hf_checkpointing(eager.llm, True, layers=1)
    compiled = copy.deepcopy(eager)
    assert compile_regions(compiled) == len(eager.encoder.blocks) + len(eager.llm.model.layers)
    assert list(compiled.state_dict()) == list(eager.state_dict())   # checkpoints see the same names
    batches = _batches()
    want_loss, want_grads = _run(eager, batches)
    before = compilations()
    got_loss, got_grads = _run(compiled, batches[:5])     # packs of 1-4 utterances and a padded batch
    warmed = compilations()
    more_loss, more_grads = _run(compiled, batches[5:])   # packs of new lengths and utterance counts
    assert warmed > before                                # it did compile
    assert compilations() == warmed, "a pack row of new lengths recompiled"
    for want, got in zip(want_loss, got_loss + more_loss):
        assert abs(want - got) <= 1e-4 * abs(want)
    for want, got in zip(want_grads, got_grads + more_grads):
        assert want.keys() == got.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.parametrize("seed_layer", [False, True])
def test_decoder_layer_with_torch_varlen_compiles_whole(monkeypatch, autocast_check_untraceable, seed_layer):
    """On CUDA the LLM's packed attention is torch's varlen op: traced into the layer's graph
    (no break at the attention; ``auto`` decided once, not traced), and new pack lengths stop
    recompiling once dynamic. Traced here on the meta device, where the op has its fake kernel.
    ``seed_layer``: the layer as seed_gpu.yaml runs it, frozen, with fused RMSNorms and the MLP
    checkpointed (``checkpoint_scope: mlp``), whole also where dynamo cannot trace the autocast
    check (torch 2.11, the GPU machines')."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import west.models.attention as attention
    from west.models.fused_norm import fuse_rms_norms
    from west.models.hf_attention import ATTN_NAME, packed_kwargs, register
    from west.models.mlp_checkpoint import checkpoint_mlps, recomputes
    from west.models.varlen_kernels import _torch_varlen_kernel

    if _torch_varlen_kernel() is None:
        pytest.skip("torch.nn.attention.varlen is not in this torch build")
    register()
    monkeypatch.setattr(attention, "choose_backend", lambda device, dtype, dropout=False: "torch_varlen")
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, attn_implementation=ATTN_NAME)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).train()
    if seed_layer:
        model.requires_grad_(False)
        assert fuse_rms_norms(model) == 3 and checkpoint_mlps(list(model.model.layers)) == 1
        assert recomputes(model.model.layers[0].mlp)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]                      # counters outlive dynamo's reset
    layer = torch.compile(model.model.layers[0].forward, fullgraph=True, backend="eager")   # a break raises
    seen = []
    for lens in ([20, 30], [10, 15, 25], [7, 60], [5, 5, 5, 41], [33], [12, 13, 14, 15, 16]):
        x = torch.randn(1, sum(lens), 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        pos = torch.cat([torch.arange(n) for n in lens])[None].to("meta")
        host = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos),
                    **packed_kwargs(host.to("meta"), max(lens), backend="auto", host_cu_seqlens=host))
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        seen.append(graphs["unique_graphs"] - before)
    assert seen[-1] <= 3 and seen[-1] == seen[-3]     # at most 3 graphs, none for the last 3 batches


def _assert_within_bf16_rounding(runs: list[torch.Tensor], name: str) -> None:
    """runs = (eager float32, eager bf16, compiled bf16): compiled's distance from eager, as a share of
    eager's norm, is at most twice bf16's own distance from float32 (a wrong mask or a mixed
    neighbour moves a gradient by tens of percent; bf16's rounding by about one)."""
    fp32, eager, compiled = (t.float() for t in runs)
    rounding = float((eager - fp32).norm() / fp32.norm())
    apart = float((compiled - eager).norm() / eager.norm())
    assert apart <= 2 * rounding + 1e-6, f"{name}: compiled is {apart:.4f} from eager, bf16's rounding {rounding:.4f}"


@pytest.mark.parametrize("pos_enc,attention,backend,graphs,bf16", [
    ("relative", "auto", "aot_eager", 3, False),
    ("wenet", "auto", "aot_eager", 3, False),     # its positional term in q and k, segment SDPA in one group
    ("wenet", "varlen", "aot_eager", 2, False),   # packed rows through a cu_seqlens kernel (CUDA's auto; no padding)
    ("wenet", "varlen", "aot_eager", 2, True)])   # as a GPU runs it: under bf16 autocast
def test_conformer_block_with_one_attention_group_compiles_whole(pos_enc, attention, backend, graphs, bf16):
    """What ``auto`` runs on CUDA (one attention group): each Conformer block is one compiled graph
    per layout, one more for a group without padding (no break at the attention or the depthwise
    convolution, ``fullgraph=True``), with
    eager's outputs and gradients, and packs or padded batches of new lengths and utterance counts
    stop recompiling once the sizes are dynamic. Dynamo's side only (aot_eager: breaks,
    recompilations and the traced graph's numbers; inductor would add about a minute of CI on a
    cold cache): inductor itself, whose convolution backward would specialise the length (compiled
    blocks run the depthwise convolution as shifted products), is checked on whole blocks by
    :func:`test_compiled_blocks_match_eager_and_stop_recompiling`. On the
    kernel route (flash-attn's CPU reference: one custom op, as the CUDA kernels) every pack shares
    one graph, the padded batches another. Under bf16 autocast, as a GPU runs it, the same graphs,
    and eager and compiled agree to bf16's rounding: compiled differs from eager (both bf16) by no
    more than twice what bf16 itself moves eager from float32, tensor by tensor (a fixed elementwise
    tolerance passed on one CPU and failed on another, whose bf16 kernels round differently)."""
    import contextlib
    import itertools

    from torch.nn.utils.rnn import pad_sequence

    from west.models.conformer import ConformerEncoder

    from helpers.e2e import tiny_encoder

    torch.manual_seed(0)
    eager = ConformerEncoder(tiny_encoder(num_blocks=1, dropout=0.0, buckets_per_octave=0, pos_enc=pos_enc,
                                           attn_backend=attention)).train()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    block = compiled.blocks[0]
    # a graph break raises; sizes dynamic from the start (train.compile lets dynamo find them,
    # one static compile earlier: test_compiled_blocks_match_eager_and_stop_recompiling)
    block.forward = torch.compile(block.forward, fullgraph=True, dynamic=True, backend=backend)
    autocast, plain = torch.autocast("cpu", dtype=torch.bfloat16), contextlib.nullcontext()
    # under bf16, eager in float32 first: the yardstick of bf16's own rounding
    runs = [(eager, plain), (eager, autocast), (compiled, autocast)] if bf16 else [(eager, plain), (compiled, plain)]
    g = torch.Generator().manual_seed(5)
    before, seen = compilations(), []
    # [210]: a group without padding (no mask: a graph of its own), its gather and inverse identities
    for lens in ([90, 130, 61], [40, 200], "padded", [210], [77, 78, 79, 80], [150, 33, 97, 120, 64], "padded",
                 [300, 45]):
        padded = lens == "padded"
        lens = [int(n) for n in torch.randint(30, 250, (3,), generator=g)] if padded else lens
        utts = [torch.randn(n, 80, generator=g) for n in lens]
        if padded:
            feats, kw = pad_sequence(utts, batch_first=True), dict(lengths=torch.tensor(lens))
        else:
            feats, kw = torch.cat(utts), dict(cu_seqlens=torch.tensor([0, *itertools.accumulate(lens)]))
        grads, outs = [], []
        for enc, precision in runs:
            with precision:
                x, _ = enc.forward_flat(feats, **kw)
            (x.float() * torch.randn(x.shape, generator=torch.Generator().manual_seed(len(lens)))).sum().backward()
            outs.append(x.detach().float())
            grads.append({n: p.grad for n, p in enc.named_parameters()})
            enc.zero_grad(set_to_none=True)
        if bf16:
            _assert_within_bf16_rounding(outs, "output")
            for n in grads[0]:
                _assert_within_bf16_rounding([g[n] for g in grads], n)
        else:
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
            for n, want in grads[0].items():
                if not n.endswith("linear_k.bias"):   # softmax is blind to it: its gradient is rounding noise
                    torch.testing.assert_close(grads[1][n], want, rtol=1e-3, atol=1e-4 * float(want.abs().max()), msg=n)
        seen.append(compilations() - before)
    assert seen[-1] == graphs and seen[-1] == seen[-4], f"graphs after each batch: {seen}"   # per layout, unpadded


def test_compiled_regions_for_a_while_then_the_blocks_own_forward():
    """The benchmark's timed passes compile the blocks only while they run: after, every block's forward is
    its class's again (operator and FLOP counters trace eager code), and compiling twice is refused."""
    from west.train.compile import compiled_regions

    model = SpeechLLM(tiny_config())
    blocks = [*model.encoder.blocks, *model.llm.model.layers]
    with compiled_regions(model) as n:
        assert n == len(blocks) and all("forward" in vars(b) for b in blocks)
        with pytest.raises(ValueError, match="compiled already"):
            with compiled_regions(model):
                pass
    assert not any("forward" in vars(b) for b in [*model.encoder.blocks, *model.llm.model.layers])
