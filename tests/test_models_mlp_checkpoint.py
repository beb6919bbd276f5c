"""model.llm.checkpoint_scope mlp: a frozen SwiGLU MLP keeps only its input and recomputes its
products in the backward. Same loss and gradients as keeping everything (bitwise in float64 and
bf16), less kept memory, fewer dispatched operators than replaying whole layers, and refused
where the MLP trains."""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from west.bench.op_counter import OpCounter
from west.models.llm import decoder_layers, llm_checkpointing
from west.models.mlp_checkpoint import FrozenSwiGLU, checkpoint_mlps
from west.models.speech_llm import SpeechLLM

from helpers.speech import packed_batch, samples, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _llm(dtype=torch.float64, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).to(dtype).train().requires_grad_(False)


def _run(model, x, autocast=None):
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
        h = model.model(inputs_embeds=x, use_cache=False).last_hidden_state
    (h.float() * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
    return h.detach(), x.grad


def _scoped(model, scope, layers=None):
    from west.models.config import LLMConfig

    llm_checkpointing(model, LLMConfig(gradient_checkpointing=True, checkpoint_scope=scope, checkpoint_layers=layers))
    return model


@pytest.mark.parametrize("dtype,autocast", [(torch.float64, None), (torch.bfloat16, None),
                                            (torch.float32, torch.bfloat16)])
def test_same_output_and_input_gradient_as_keeping_everything(dtype, autocast):
    """float64, a bf16 LLM, and an fp32 LLM under bf16 autocast (the input's gradient comes back in fp32)."""
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    h0, g0 = _run(_llm(dtype), x, autocast)
    h1, g1 = _run(_scoped(_llm(dtype), "mlp"), x, autocast)
    assert g1.dtype == dtype
    assert torch.equal(h1, h0) and torch.equal(g1, g0)   # the same operators on the same values
    h2, g2 = _run(_scoped(_llm(dtype), "layer"), x, autocast)
    assert torch.equal(h2, h0) and torch.equal(g2, g0)


def test_keeps_only_the_mlp_input():
    """The saved tensors of one MLP call: its input and the (already resident) weights; none of
    its intermediate activations (gate, up, silu(gate), their product)."""
    mlp = _llm(torch.float32).model.layers[0].mlp
    checkpoint_mlps([_llm(torch.float32).model.layers[0]])   # another model's layer: this mlp is plain
    x = torch.randn(3, 7, 32, requires_grad=True)

    def saved_activation_elements(module):
        kept = []
        weights = {w.data_ptr() for w in module.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            module(x * 1.0)
        return sum(t.numel() for t in kept if t.data_ptr() not in weights and t.data_ptr() != x.data_ptr())

    plain = saved_activation_elements(mlp)
    assert plain >= 3 * 3 * 7 * 80                   # gate, up, silu(gate) at 80 wide
    layer = _llm(torch.float32).model.layers[0]
    checkpoint_mlps([layer])
    assert saved_activation_elements(layer.mlp) == 3 * 7 * 32   # the input alone (x * 1.0)


def test_fewer_dispatched_operators_than_replaying_layers():
    """The host work it saves on a GPU: a step with scope mlp dispatches fewer operators than
    with whole layers replayed, and its backward no more than keeping everything plus the two
    recomputed products per layer."""
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def ops(model):
        counter = OpCounter()
        with counter:
            _run(model, x)
        return counter.totals()["total"]

    plain, layer, mlp = ops(_llm(torch.bfloat16)), ops(_scoped(_llm(torch.bfloat16), "layer")), \
        ops(_scoped(_llm(torch.bfloat16), "mlp"))
    assert plain < mlp < layer
    assert mlp - plain <= 2 * 10        # per layer: two products and their views
    assert layer - mlp >= 2 * 30        # a replayed layer: ~40 operators and the framework's detaches


def test_checkpoint_layers_limits_the_scope():
    model = _scoped(_llm(torch.float32, layers=3), "mlp", layers=2)
    patched = ["forward" in vars(layer.mlp) for layer in decoder_layers(model)]
    assert patched == [True, True, False]


def test_a_trainable_or_wrapped_projection_runs_the_models_forward():
    """Outside the config's rules (a hand-built model): the MLP still computes exactly, weight
    gradients included, through the model's own forward."""
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    plain, scoped = _llm(torch.float32), _scoped(_llm(torch.float32), "mlp")
    for m in (plain, scoped):
        m.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    _, g0 = _run(plain, x)
    _, g1 = _run(scoped, x)
    assert torch.equal(g0, g1)
    w0, w1 = plain.model.layers[0].mlp.up_proj.weight.grad, scoped.model.layers[0].mlp.up_proj.weight.grad
    assert w1 is not None and torch.equal(w0, w1)


def test_gradcheck():
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64),
          torch.randn(6, 5, dtype=torch.float64)]
    assert torch.autograd.gradcheck(lambda t: FrozenSwiGLU.apply(t, *ws), (x,))


def test_a_trainable_mlp_is_refused_when_routed():
    """train.grad_checkpointing reaches checkpoint_mlps without the config's rule: it refuses too."""
    layer = _llm(torch.float32).model.layers[0]
    layer.mlp.down_proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="checkpoint_scope mlp: decoder layer 0's MLP trains"):
        checkpoint_mlps([layer])


def test_a_non_swiglu_block_is_refused():
    layer = _llm(torch.float32).model.layers[0]
    layer.mlp.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="checkpoint_scope mlp: Qwen2DecoderLayer has no SwiGLU mlp"):
        checkpoint_mlps([layer])


def test_in_the_speech_llm_same_loss_and_gradients():
    """Through SpeechLLM (frozen LLM, packed batch): every trainable gradient equals scope layer's."""
    ss = samples()
    batch = packed_batch(ss, sum(len(s.ids) for s in ss) + 4)
    out = {}
    for scope in ("layer", "mlp"):
        cfg = tiny_config()
        cfg.freeze_llm, cfg.llm.gradient_checkpointing, cfg.llm.checkpoint_scope = True, True, scope
        torch.manual_seed(0)
        model = SpeechLLM(cfg).train()
        loss = model(batch)["loss_sum"]
        loss.backward()
        out[scope] = (float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert out["mlp"][0] == out["layer"][0]
    assert out["mlp"][1].keys() == out["layer"][1].keys() and out["mlp"][1]
    for name, g in out["layer"][1].items():
        torch.testing.assert_close(out["mlp"][1][name], g, rtol=1e-6, atol=1e-8, msg=name)


def test_config_rules(tmp_path):
    from west.config import load_config
    from west.schema import ConfigError

    _llm(torch.float32).save_pretrained(tmp_path)
    path = ("model.llm.path", str(tmp_path))
    # with checkpointing off the scope is not read: seed_gpu.yaml's scope plus a command-line "false"
    off = load_config(None, [("model.llm.checkpoint_scope", "mlp"), ("model.freeze_llm", "false"), path])
    assert not off.model.llm.recomputes_mlps()
    on = [("model.llm.gradient_checkpointing", "true"), ("model.llm.checkpoint_scope", "mlp")]
    with pytest.raises(ConfigError, match="model.freeze_llm.*checkpoint_scope mlp"):
        load_config(None, [*on, ("model.freeze_llm", "false")])
    with pytest.raises(ConfigError, match="model.lora.*checkpoint_scope mlp"):
        load_config(None, [*on, ("model.lora.target_modules", "[q_proj, up_proj]")])
    cfg = load_config(None, [*on, ("model.lora.target_modules", "[q_proj, v_proj]"), path])
    assert cfg.model.llm.checkpoint_scope == "mlp"


def test_compiled_layers_trace_it_without_a_break(autocast_check_untraceable):
    """train.compile compiles each decoder layer: the Function traces into its graph (no graph
    break, also where dynamo cannot trace the autocast check, as in torch 2.11) and the compiled
    step computes what eager does."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    eager = _run(_scoped(_llm(torch.float32), "mlp"), x)
    model = _scoped(_llm(torch.float32), "mlp")
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, backend="aot_eager")
    compiled = _run(model, x)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_compiled_layers_keep_no_mlp_intermediate():
    """Under train.compile a layer's MLP still keeps only its input. Traced, the Function's
    recomputation was merged with the forward's products, which were then kept after all (the
    H200: 6.6 GiB more at pack 8192); the compiled path is a checkpoint region, which the compiler
    recomputes. The check: no saved tensor is 80 wide (intermediate_size), weights aside."""
    def saved_intermediates(model):
        weights = {p.data_ptr() for p in model.parameters()}
        kept = []
        x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            h = model.model(inputs_embeds=x, use_cache=False).last_hidden_state
        h.sum().backward()
        return [tuple(t.shape) for t in kept if t.data_ptr() not in weights and t.dim() and t.shape[-1] == 80]

    def compiled(model):
        for layer in decoder_layers(model):
            layer.forward = torch.compile(layer.forward, backend="aot_eager")
        return model

    torch._dynamo.reset()
    assert saved_intermediates(compiled(_llm(torch.float32)))   # the check sees what a plain layer keeps
    assert not saved_intermediates(_scoped(_llm(torch.float32), "mlp"))
    assert not saved_intermediates(compiled(_scoped(_llm(torch.float32), "mlp")))
    torch._dynamo.reset()
