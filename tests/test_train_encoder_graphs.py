"""train.encoder_graphs through west-train on the CPU: every pack runs the Conformer's blocks on
rows padded to train.encoder_graph_rows (what one captured graph replays on CUDA), and the run's
per-step losses and final weights are those of the same run unpadded; the last line counts the
batches. The config refuses what the captured blocks cannot do."""
import re
from types import SimpleNamespace

import pytest
import torch

from west.config import load_config
from west.models.static_encoder import StaticBlocks, StaticShape
from west.schema import ConfigError
from west.shapes import PackExtent

from helpers.e2e import TINY_CPU, assert_same_final_weights, assert_same_steps, eager_and_graphed, tiny_llm

KERNEL_PACKS = ["--batch_type", "pack", "--pack_tokens", "200", "--max_steps", "3", "--train.save_every", "0",
                "--model.encoder.pos_enc", "wenet", "--model.encoder.attn_backend", "varlen"]


def test_padded_encoder_blocks_train_like_unpadded_ones(tmp_path_factory, corpus):
    # run "eager" asks for auto, which the CPU turns down (it would pad and not replay), saying why
    d, out = eager_and_graphed(tmp_path_factory, corpus, "encoder_graphs", [*KERNEL_PACKS, "--train.encoder_graphs", "auto"], [
        "--train.encoder_graphs", "true", "--train.encoder_graph_rows", "1024", "--train.encoder_graph_max_len", "256"])
    assert_same_steps(d, 3, "computed_enc_frames")
    # products over more rows round differently: up to 2e-6 apart after 3 steps
    assert_same_final_weights(d, 3, atol=1e-5)
    # packs of 200 LLM positions hold at most 400 encoder rows (2 per position): at most 39 % of the 1,024 real
    share = re.search(r"3 encoder batches padded \(eager\) at 1024 rows \((\d+) % of them real\), 0 unpadded "
                      r"\(train.encoder_graphs\)", out["graphs"])
    assert share and 0 < int(share[1]) <= 39, out["graphs"]
    # the start says the shape and where each size comes from: rows and bound as set, the slots from the plan
    assert re.search(r"train.encoder_graphs: the encoder's blocks replay at 1,024 rows per pack in 32 segments of at "
                     r"most 256 frames \(rows: train.encoder_graph_rows; segments: the fullest planned pack holds \d+ "
                     r"utterances, and the padding up to 4 segments, rounded up to a multiple of 32; longest: "
                     r"train.encoder_graph_max_len\)", out["graphs"]), out["graphs"]
    assert "train.encoder_graphs auto: false (needs CUDA, the run is on cpu)" in out["eager"]
    assert "encoder batches" not in out["eager"] and "auto" not in out["graphs"]


PACK = ["--data.batch_type", "pack", "--data.pack_tokens", "200"]
WENET = ["--model.encoder.pos_enc", "wenet"]


@pytest.mark.parametrize("extra,message", [
    (PACK, "needs west's Conformer with model.encoder.pos_enc wenet"),
    (PACK + WENET + ["--train.accum_steps", "2"], "needs train.accum_steps 1"),
    (PACK + WENET + ["--model.freeze_encoder", "true"], "needs a trained encoder"),
    (PACK + WENET + ["--train.encoder_graph_rows", "400", "--train.encoder_graph_segments", "256",
                     "--train.encoder_graph_max_len", "1"], "train.encoder_graph_segments: must be >= 401"),
    (WENET + ["--data.batch_type", "static"], "needs data.batch_type pack")])
def test_the_config_refuses_what_the_graphs_cannot_do(tmp_path_factory, extra, message):
    from west.config import split_overrides

    argv = ["--model.llm.path", str(tiny_llm(tmp_path_factory)), "--train.encoder_graphs", "true", *extra]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(str(TINY_CPU), split_overrides(argv))


def test_the_benchmark_pads_packed_modes_only_and_restores_the_encoder():
    from west.bench.benchmark import graphed_encoder
    from west.bench.modes import standard_modes
    from west.models.speech_llm import SpeechLLM
    from west.train.config import TrainConfig

    from helpers.speech import tiny_config

    cfg = tiny_config()
    cfg.encoder.pos_enc, cfg.encoder.attn_backend = "wenet", "varlen"
    model = SpeechLLM(cfg)
    train = TrainConfig(encoder_graphs=True)
    static_mode, pack_mode = standard_modes(["static", "pack"], 4, 512, 2000)
    # the mode's batches: fbank frames per utterance, 4x subsampled to (n - 3) // 4 encoder frames
    batches = [SimpleNamespace(feat_lens=torch.tensor([1203, 1603])), SimpleNamespace(feat_lens=torch.tensor([4403]))]
    with graphed_encoder(model, static_mode, train, torch.device("cpu"), batches) as static:
        assert static is None and model.encoder.static_blocks is None
    with graphed_encoder(model, pack_mode, train, torch.device("cpu"), batches) as static:   # 700 and 1,100 frames
        assert model.encoder.static_blocks is static
        # 1,100 rows rounded up to 512s; the longest (1,100) to 128s; 2 utterances + 2 padding segments to 32s
        assert static.shape == StaticShape(1536, 32, 1152)
    assert model.encoder.static_blocks is None
    with graphed_encoder(model, pack_mode, train, torch.device("cpu"), []) as static:
        assert static.shape == StaticShape(2000 * 2, 256, 1024)   # no batches seen: bounds any pack fits
    train = TrainConfig(encoder_graphs=True, encoder_graph_max_len=64)
    with graphed_encoder(model, pack_mode, train, torch.device("cpu"), batches) as static:
        assert static.shape == StaticShape(1536, 32, 64)   # 2 + 1536 / 64 = 26 slots, in 32s


def test_the_slots_and_the_bound_are_the_plans_unless_set():
    from west.train.config import TrainConfig
    from west.train.encoder_graphs import LENGTH_STEP, SEGMENTS_STEP, encoder_max_len, encoder_segments, encoder_shape

    assert (LENGTH_STEP, SEGMENTS_STEP) == (128, 32)
    assert encoder_max_len(0, 333) == (384, "the longest planned utterance has 333 encoder frames, rounded up to 128")
    assert encoder_max_len(0, 384)[0] == 384 and encoder_max_len(0) == (1024, "no plan: 1,024 frames")
    assert encoder_max_len(500, 333) == (500, "train.encoder_graph_max_len")
    # the built-in corpus: 137 utterances in its fullest pack, 11,264 rows in segments of at most 384 (30 of padding)
    assert encoder_segments(0, 11264, 384, 137) == (192, "the fullest planned pack holds 137 utterances, and the "
                                                         "padding up to 30 segments, rounded up to a multiple of 32")
    assert encoder_segments(0, 11264, 384) == (256, "no plan: 256 slots")
    assert encoder_segments(0, 16384, 8)[0] == 2049   # no plan, and more padding than 256 slots hold
    assert encoder_segments(64, 11264, 384, 137) == (64, "train.encoder_graph_segments")   # fewer: later eager
    with pytest.raises(ConfigError, match="train.encoder_graph_segments: must be >= 31: one utterance and 11,264 rows"):
        encoder_segments(30, 11264, 384, 137)
    shape, why = encoder_shape(TrainConfig(encoder_graphs=True), 8192, 2, PackExtent(11081, 137, 333))
    assert shape == StaticShape(11264, 192, 384)
    assert why.startswith("rows: the largest planned pack holds 11,081 encoder frames") and "; segments: " in why
    assert encoder_shape(TrainConfig(encoder_graphs=True), 8192, 2)[0] == StaticShape(16384, 256, 1024)


def test_the_rows_are_the_largest_planned_pack_rounded_up_within_the_bound():
    from west.train.encoder_graphs import ROWS_STEP, encoder_rows

    assert ROWS_STEP == 512
    assert encoder_rows(0, 8192, 2, 9650) == (
        9728, "the largest planned pack holds 9,650 encoder frames, rounded up to a multiple of 512")
    assert encoder_rows(0, 8192, 2, 10240)[0] == 10240 and encoder_rows(0, 8192, 2, 10241)[0] == 10752
    assert encoder_rows(0, 8192, 2, 16300)[0] == 16384   # never past pack x stride
    assert encoder_rows(0, 8192, 2) == (16384, "no plan: pack_tokens 8,192 x projector stride 2, which any pack fits")
    assert encoder_rows(12288, 8192, 2, 9650) == (12288, "train.encoder_graph_rows")   # set: as set


def test_a_route_without_a_kernel_or_several_ranks_is_refused():
    from west.models.speech_llm import SpeechLLM
    from west.train.encoder_graphs import static_encoder_for

    from helpers.speech import tiny_config

    cfg = tiny_config()
    cfg.encoder.pos_enc = "wenet"   # attn_backend auto: segment SDPA on the CPU
    model = SpeechLLM(cfg)
    shape = StaticShape(tokens=400, segments=16, max_seqlen=64)
    with pytest.raises(ConfigError, match="the encoder's packed rows run sdpa_segments on cpu"):
        static_encoder_for(model, shape, "fp32", torch.device("cpu"))
    with pytest.raises(ConfigError, match="one process only"):
        static_encoder_for(model, shape, "fp32", torch.device("cpu"), world_size=2)


def test_capture_records_the_padded_stack_and_replays_it(monkeypatch):
    """The capture's plumbing on the CPU, make_graphed_callables replaced by a recorder that hands the
    module back: bf16 autocast inside the stack, the sample at the static shape in bf16 with x
    requiring grad, and the replay refusing gradients left from an earlier backward."""
    from west.models.speech_llm import SpeechLLM
    from west.train.encoder_graphs import capture

    from helpers.speech import tiny_config

    seen = {}

    def record(module, sample, num_warmup_iters):
        seen.update(module=module, sample=sample, warmup=num_warmup_iters)
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", record)
    cfg = tiny_config()
    cfg.encoder.pos_enc, cfg.encoder.attn_backend = "wenet", "varlen"
    enc = SpeechLLM(cfg).encoder.train()
    static = StaticBlocks(enc, StaticShape(tokens=256, segments=16, max_seqlen=64), "flash")
    capture(static, "bf16", warmup_iters=2)
    x, pos, cu, gap = seen["sample"]
    assert seen["module"] is static.stack and static.replay is static.stack and seen["warmup"] == 2
    assert x.shape == (256, enc.output_dim) and x.dtype == torch.bfloat16 and x.requires_grad
    assert pos.dtype == torch.bfloat16 and cu.shape == (17,) and gap.shape == (256,)
    assert static.stack.autocast == torch.bfloat16
    out = static.stack(*seen["sample"])
    assert out.dtype == torch.bfloat16   # autocast inside the stack
    lens = [30, 50]
    feats = torch.randn(sum(lens) * 4 + 12, 80)
    cu_feats = torch.tensor([0, 120 + 6, sum(lens) * 4 + 12], dtype=torch.int32)
    enc.static_blocks = static
    y, _ = enc(feats, cu_seqlens=cu_feats)
    y.float().sum().backward()   # gradients on the weights now: the next replay must refuse
    with pytest.raises(RuntimeError, match="still hold gradients"):
        enc(feats, cu_seqlens=cu_feats)
    enc.zero_grad(set_to_none=True)
    enc(feats, cu_seqlens=cu_feats)
    assert static.counts["static"] == 2
    monkeypatch.setattr(torch.cuda, "make_graphed_callables",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("capture broke")))
    with pytest.raises(RuntimeError, match="train.encoder_graphs: capturing the encoder's blocks at .*capture broke"):
        capture(static, "bf16")


def test_compiled_blocks_at_the_static_shape_match_eager_and_compile_once(tmp_path_factory, one_torch_thread):
    """train.compile with train.encoder_graphs: the padded stack's compiled blocks (what a capture
    records on CUDA) give the eager stack's output and gradients, and packs of other utterance
    lengths reuse the one graph compiled at the static shape. The config takes the pair."""
    import copy

    from west.config import split_overrides
    from west.models.speech_llm import SpeechLLM
    from west.train.compile import compilations, compile_regions

    from helpers.speech import tiny_config

    argv = ["--model.llm.path", str(tiny_llm(tmp_path_factory)), "--train.encoder_graphs", "true",
            "--train.compile", "true", *PACK, *WENET]
    assert load_config(str(TINY_CPU), split_overrides(argv)).train.compile
    torch.manual_seed(0)
    cfg = tiny_config()
    cfg.encoder.pos_enc, cfg.encoder.attn_backend, cfg.encoder.dropout = "wenet", "varlen", 0.0
    eager = SpeechLLM(cfg).train()
    compiled = copy.deepcopy(eager)
    assert compile_regions(compiled) == len(eager.encoder.blocks) + len(eager.llm.model.layers)
    shape = StaticShape(tokens=256, segments=16, max_seqlen=64)
    results, counts = [], [compilations()]
    for model in (eager, compiled):
        enc, g = model.encoder, torch.Generator().manual_seed(1)
        static, outs = StaticBlocks(enc, shape, "flash"), []
        for lens in ([30, 50, 20], [60, 10, 41, 7]):
            x = torch.randn(sum(lens), enc.output_dim, generator=g, requires_grad=True)
            y = static.stack(*static.inputs(x, lens))[: x.shape[0]]
            y.square().sum().backward()
            outs.append((y.detach(), x.grad, {n: p.grad for n, p in enc.blocks.named_parameters()}))
            enc.zero_grad(set_to_none=True)
            counts.append(compilations())
        results.append(outs)
    assert counts[0] == counts[1] == counts[2] < counts[3] == counts[4]   # compiled once, statically
    for (y0, gx0, gw0), (y1, gx1, gw1) in zip(*results):
        torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-5)
        assert gw0.keys() == gw1.keys() and all(g is not None for g in gw1.values())
        for n in gw0:
            torch.testing.assert_close(gw1[n], gw0[n], rtol=1e-3, atol=1e-4, msg=n)


@pytest.mark.parametrize("device,world,extra,decided", [
    ("cuda", 1, [], "true (the Conformer's blocks replayed from CUDA graphs)"),
    ("cpu", 1, [], "false (needs CUDA, the run is on cpu)"),
    ("cuda", 2, [], "false (one process only (the graph's weight gradients are not reduced across ranks by DDP's "
                    "hooks), the run has 2)"),
    ("cuda", 1, ["--train.precision", "fp32"], "false (the encoder's packed rows run sdpa_segments on cuda"),
    ("cuda", 1, ["--train.accum_steps", "2"], "false (needs train.accum_steps 1"),
    ("cuda", 1, ["--data.batch_type", "static"], "false (needs data.batch_type pack, got static)"),
    ("cuda", 1, ["sized eagerly"], "false (--memory_budget sizes eager steps")])
def test_auto_turns_the_replay_on_only_where_it_runs(tmp_path_factory, monkeypatch, device, world, extra, decided):
    """seed_gpu.yaml's ``auto``: on for one CUDA process on the kernel route, else off with the reason
    (decided from the config alone, nothing built; the GPU's capability check answers as an sm90's)."""
    from west.config import split_overrides
    from west.train.encoder_graphs import resolve_encoder_graphs

    monkeypatch.setattr("west.models.varlen_kernels._sm80", lambda device: True)
    batching = [] if "--data.batch_type" in extra else PACK
    sized_eagerly = extra == ["sized eagerly"]   # west-benchmark --memory_budget
    argv = ["--model.llm.path", str(tiny_llm(tmp_path_factory)), *batching, *WENET, "--train.precision", "bf16",
            "--train.encoder_graphs", "auto", *([] if sized_eagerly else extra)]
    cfg = load_config(str(TINY_CPU), split_overrides(argv))
    assert cfg.train.encoder_graphs == "auto"
    note = resolve_encoder_graphs(cfg, torch.device(device), world, sized_eagerly)
    assert note.startswith(f"train.encoder_graphs auto: {decided}")
    assert cfg.train.encoder_graphs == decided.split()[0]
    assert resolve_encoder_graphs(cfg, torch.device(device), world) is None   # decided once


def test_yaml_booleans_and_words_both_read():
    from west.train.config import TrainConfig

    assert TrainConfig.from_dict({"encoder_graphs": True}).encoder_graphs == "true"
    assert TrainConfig.from_dict({"encoder_graphs": False}).encoder_graphs == "false"
    assert TrainConfig.from_dict({"encoder_graphs": "auto"}).encoder_graphs == "auto"
    with pytest.raises(ConfigError, match="train.encoder_graphs: must be one of"):
        TrainConfig.from_dict({"encoder_graphs": "sometimes"})
