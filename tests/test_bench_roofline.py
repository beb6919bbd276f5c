"""west.lab.traffic, west.lab.cuda_standins and west.lab.roofline: the bytes each operator
moves, its floor, a meta-device step that dispatches CUDA's kernels (and the same products as the
real step on the CPU), and tools/step_roofline.py's table and JSON."""
import json

import pytest
import torch

from west.lab.traffic import Roofline, Traffic, moved_bytes, varlen_attention_flops

from helpers.e2e import import_tool


def test_views_and_allocations_move_nothing_and_in_place_writes_count_once():
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    with Traffic() as mode:
        a.view(8, 4)                       # a view
        torch.empty_like(a)                # memory handed out, nothing written
        torch.randn(2, 4, 8) @ torch.randn(8, 3)   # bmm-free: mm on a (8, 8) view, then _unsafe_view back
        a.add_(b)                          # reads a and b, writes a: 3 x 128 bytes
        a.copy_(b)                         # reads b, writes a: 2 x 128
    assert mode.calls["add_"] == 1 and mode.by_op["add_"] == 3 * 128
    assert mode.by_op["copy_"] == 2 * 128
    assert "empty_like" not in mode.calls and "_unsafe_view" not in mode.calls and "view" not in mode.calls
    assert mode.by_op["mm"] == (8 * 8 + 8 * 3 + 8 * 3) * 4
    assert moved_bytes("fill_", (a, 1.0), {}, a) == 128   # a fill writes only


def test_an_operators_floor_is_its_bytes_or_its_flops_whichever_is_longer():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    flops, moved = 2 * 64 * 32 * 16, (64 * 32 + 32 * 16 + 64 * 16) * 4
    with Roofline(bandwidth=1e9, peak=1e15) as memory_bound:
        a @ b
    with Roofline(bandwidth=1e15, peak=1e6) as compute_bound:
        a @ b
    assert memory_bound.flops_by_op["mm"] == flops and memory_bound.by_op["mm"] == moved
    assert memory_bound.floor_s == pytest.approx(moved / 1e9)
    assert compute_bound.floor_s == pytest.approx(flops / 1e6)


def test_varlen_attention_flops():
    fwd, bwd = varlen_attention_flops([3, 5], heads=2, head_dim=4, causal=False)
    assert fwd == 4 * 2 * 4 * (9 + 25) and bwd == int(2.5 * fwd)
    assert varlen_attention_flops([3, 5], 2, 4, causal=True)[0] == fwd // 2


def _model_config(llm: str, dropout: float, fused_norm: bool, encoder_attention: str = "auto"):
    from west.models.config import SpeechLLMConfig

    return SpeechLLMConfig.from_dict({
        "encoder": {"d_model": 32, "num_heads": 2, "ffn_dim": 64, "num_blocks": 2, "conv_kernel": 3,
                    "dropout": dropout, "pos_enc": "wenet", "attn_backend": encoder_attention},
        "projector": {"stride": 2, "hidden_dim": 32},
        "llm": {"path": llm, "attn_implementation": "west_varlen", "dtype": "float32", "fused_norm": fused_norm},
        "freeze_llm": True})


@pytest.fixture(scope="module")
def setup(tmp_path_factory, corpus):
    from west.bench.benchmark import load_batches
    from west.data.config import DataConfig
    from west.models.llm import load_tokenizer
    from west.models.tiny_llm import build_tiny_llm

    d = tmp_path_factory.mktemp("roofline")
    llm = build_tiny_llm(list(corpus["texts"].values()) + ["Transcribe the speech."], d / "llm", vocab_size=300,
                         hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_size=64)
    cfg = _model_config(str(llm), 0.1, True)
    conf = DataConfig(batch_type="pack", pack_tokens=512, num_workers=0, dither=0.0, spec_aug=False)
    batches = load_batches(str(corpus["list"]), load_tokenizer(llm), conf, cfg.speech_shape(), 0)[0]
    return {"llm": llm, "batch": batches[0], "dir": d}


def test_the_meta_step_dispatches_cudas_kernels(setup):
    from west.lab.roofline import meta_model, segment_lengths, step_floor

    model = meta_model(_model_config(str(setup["llm"]), 0.1, True), setup["llm"])
    assert all(p.device.type == "meta" for p in model.parameters())
    assert {p.dtype for n, p in model.named_parameters() if not n.startswith("llm.")} == {torch.bfloat16}
    res = step_floor(model, setup["batch"], 3e12, 8e14)
    ops = res["ops"]
    # one attention kernel per encoder block and per decoder layer, each way
    assert ops["attention"]["calls"] == ops["attention_backward"]["calls"] == 2 + 3
    # the LLM's 2 norms per layer and its final one, each one kernel; no float32 chain of them
    assert ops["rms_norm"]["calls"] == ops["rms_norm_backward"]["calls"] == 2 * 3 + 1
    assert "rsqrt" not in ops and "pow" not in ops
    assert ops["native_dropout"]["calls"] > 0 and "bernoulli_" not in ops    # CUDA's fused dropout
    seg = segment_lengths(model, setup["batch"])
    host = setup["batch"].host
    assert sum(seg[True]) == host.input_ids.numel() and len(seg[False]) == len(host.feat_lens)
    heads, head_dim = 2, 16   # the decoder's attention: 2 query heads of 16
    fwd = sum(varlen_attention_flops(seg[True], heads, head_dim, True)[0] for _ in range(3))
    # the encoder's: WeNet's term makes q and k 2 x 16 wide, and v is padded to match
    assert ops["attention"]["flops"] == fwd + 2 * varlen_attention_flops(seg[False], 2, 32, False)[0]
    opt = ops["optimizer (AdamW + clip, by arithmetic)"]
    assert opt["bytes"] == 40 * res["trainable_params"] > 0
    assert res["stand_ins"] == ["attention", "attention_backward", "rms_norm", "rms_norm_backward"]
    # the encoder alone: its 2 attention kernels each way, part of the step's products and floor
    enc = res["encoder"]
    assert enc["flops"] >= 2 * sum(varlen_attention_flops(seg[False], 2, 32, False))
    whole = sum(v["floor_s"] for v in ops.values())
    assert 0 < enc["floor_s"] < whole and 0 < enc["flops"] < sum(v["flops"] for v in ops.values())


def test_the_meta_step_runs_the_cpu_steps_products(setup):
    """Same model and batch: the products' FLOPs by operator on the meta device (stand-ins in)
    equal those of the real step on the CPU, counted by torch's FLOP counter. The encoder takes the
    cu_seqlens route on the CPU too (the kernel's reference): segment SDPA groups its positions."""
    from torch.utils.flop_counter import FlopCounterMode

    from west.lab.roofline import meta_model, step_floor
    from west.models.speech_llm import SpeechLLM

    cfg = _model_config(str(setup["llm"]), 0.0, False, encoder_attention="varlen")
    meta = step_floor(meta_model(cfg, setup["llm"]), setup["batch"], 3e12, 8e14)["ops"]
    real = SpeechLLM(cfg).train()
    counter = FlopCounterMode(display=False)
    with counter:
        real(setup["batch"])["loss_sum"].backward()
    cpu = {str(k).split(".")[-1]: v for k, v in counter.get_flop_counts()["Global"].items()}
    for op in ("mm", "addmm", "convolution", "convolution_backward"):
        assert meta[op]["flops"] == cpu[op] > 0, op


def test_the_tool_writes_its_table_and_json(setup, corpus, tmp_path, capsys):
    step_roofline = import_tool("step_roofline")
    conf = tmp_path / "conf.yaml"
    conf.write_text("train: {device: cpu}\ndata: {batch_type: pack, pack_tokens: 512, num_workers: 0}\n"
                    "model:\n  encoder: {d_model: 32, num_heads: 2, ffn_dim: 64, num_blocks: 2, conv_kernel: 3, "
                    "pos_enc: wenet}\n  projector: {stride: 2, hidden_dim: 32}\n"
                    "  llm: {attn_implementation: west_varlen, dtype: bfloat16, fused_norm: true}\n  freeze_llm: true\n",
                    encoding="utf-8")
    out = tmp_path / "out"
    assert step_roofline.main(["--config", str(conf), "--llm", str(setup["llm"]), "--data", str(corpus["list"]),
                               "--batches", "2", "--out_dir", str(out), "--measured_step_s", "0.5"]) == 0
    text = capsys.readouterr().out
    res = json.loads((out / "roofline.json").read_text())
    assert len(res["steps"]) == 2
    whole = res["totals"]["whole"]
    assert whole["floor_s"] == pytest.approx(sum(v["floor_s"] for s in res["steps"] for v in s["ops"].values()))
    assert whole["floor_s"] == pytest.approx(sum(c["floor_s"] for c in res["totals"]["categories"].values()))
    assert "| **whole step** |" in text and "| products |" in text and "MFU at most" in text
    assert "of it the speech encoder (its forward and backward counted again alone):" in text
    assert "measured step 500 ms" in text and (out / "roofline.md").read_text().startswith("| per step (mean of 2)")
    with pytest.raises(SystemExit, match="counts pack steps .* data.batch_type is 'static'"):
        step_roofline.main(["--config", str(conf), "--llm", str(setup["llm"]), "--data", str(corpus["list"]),
                            "--out_dir", str(out), "--data.batch_type", "static"])


def test_a_config_only_seed_llm_counts_at_its_real_width(setup, tmp_path):
    """tools/make_seed_llm.py --config_only: Qwen2-1.5B's config.json, no weights; its frozen decoder
    layers then cost 4 FLOPs per parameter per token (forward, and the backward to their inputs)."""
    from west.lab.roofline import meta_model, step_floor

    make_seed_llm = import_tool("make_seed_llm")
    out = tmp_path / "seed_llm"
    assert make_seed_llm.main([str(out), "--tokenizer", str(setup["llm"]), "--config_only"]) == 0
    assert (out / "config.json").is_file() and not list(out.glob("*.safetensors"))
    cfg = _model_config(str(out), 0.0, True)
    cfg.llm.dtype = "bfloat16"
    model = meta_model(cfg, out)
    layers = sum(p.numel() for p in model.llm.model.layers.parameters() if p.dim() == 2)   # the products' weights
    assert 1.3e9 < layers < 1.4e9
    res = step_floor(model, setup["batch"], 3e12, 8e14)
    tokens = setup["batch"].host.input_ids.numel()
    products = res["ops"]["mm"]["flops"] + res["ops"]["addmm"]["flops"]
    assert 4 * layers * tokens <= products <= 1.1 * 4 * layers * tokens


def test_kernels_are_named_into_the_floors_categories():
    from west.lab import roofline
    from west.lab.kernel_kinds import CATEGORIES, by_category, kernel_category

    assert set(CATEGORIES) == {*roofline.CATEGORIES, roofline.OTHER, roofline.OPTIMIZER}
    names = {   # as torch.profiler names them on an H100 (torch 2.11)
        "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN": "products",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "products",
        "void at::native::conv_depthwise2d_forward_kernel<3, c10::BFloat16, int>(...)": "products",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>(...)": "attention",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(...)": "norms",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)": "copies and casts",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)>(...)": "copies and casts",
        "Memcpy HtoD (Pinned -> Device)": "copies and casts",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ...>(...)":
            "elementwise and reductions",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<...>>>(...)":
            "elementwise and reductions",
        "triton_poi_fused_mul_silu_0": "elementwise and reductions",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...FusedAdamMathFunctor...>(...)": "optimizer",
    }
    assert {n: kernel_category(n) for n in names} == names
    events = [{"name": "nvjet_x", "dur": 3000.0}, {"name": "nvjet_y", "dur": 1000.0},
              {"name": "triton_poi_fused_add_0", "dur": 500.0}]
    assert by_category(events, steps=2) == {"products": {"kernels_per_step": 1.0, "ms_per_step": 2.0},
                                            "elementwise and reductions": {"kernels_per_step": 0.5, "ms_per_step": 0.25}}


def test_the_tool_sets_a_profiles_kernels_against_the_floor(setup, corpus, tmp_path, capsys):
    step_roofline = import_tool("step_roofline")
    conf = tmp_path / "conf.yaml"
    conf.write_text("train: {device: cpu}\ndata: {batch_type: pack, pack_tokens: 512, num_workers: 0}\n"
                    "model:\n  encoder: {d_model: 32, num_heads: 2, ffn_dim: 64, num_blocks: 1, conv_kernel: 3}\n"
                    "  projector: {stride: 2, hidden_dim: 32}\n  llm: {dtype: bfloat16}\n  freeze_llm: true\n",
                    encoding="utf-8")
    profile = tmp_path / "kernels.json"
    cats = {"products": {"kernels_per_step": 10.0, "ms_per_step": 4.0},
            "elementwise and reductions": {"kernels_per_step": 30.0, "ms_per_step": 1.0}}
    profile.write_text(json.dumps({"device": "NVIDIA H100", "modes": {"pack": {
        "steps": 3, "step_ms": 6.0, "gpu_busy_pct": 83.3, "by_category": cats}}}))
    assert step_roofline.main(["--config", str(conf), "--llm", str(setup["llm"]), "--data", str(corpus["list"]),
                               "--num_utts", "10", "--out_dir", str(tmp_path / "out"), "--kernels", str(profile)]) == 0
    text = capsys.readouterr().out
    res = json.loads((tmp_path / "out" / "roofline.json").read_text())
    floor = res["totals"]["categories"]["products"]["floor_s"] / len(res["steps"]) * 1e3   # per step
    assert f"| products | 10 | 4.0 | {floor:.1f} | {4.0 / floor:.1f}x |" in text
    assert "(pack, NVIDIA H100, 3 steps, 6.0 ms per step, GPU busy 83 %)" in text
    # the benchmark's draw of 10 utterances, every batch of them counted
    assert len((tmp_path / "out" / "roofline_data.list").read_text().splitlines()) == 10
    assert sum(s["utterances"] for s in res["steps"]) == 10
