"""west.lab.encoder_time and tools/encoder_gpu_time.py on the CPU: the traffic counter's bytes for
known operators, attention's FLOPs, the kernel summary of a trace, and the tool's table and JSON
(the replay and the kernel columns are CUDA's; the CPU run leaves them out and says so), with the
blocks compiled too."""
import json

import torch

from west.lab.encoder_time import attention_flops, kernel_summary, table
from west.lab.traffic import Traffic

from helpers.e2e import ROOT, import_tool


def test_traffic_counts_each_operators_tensors_in_and_out_and_skips_views():
    a, b = torch.randn(10), torch.randn(10)
    with Traffic() as mode:
        c = a + b            # reads 2 x 40 bytes, writes 40
        c.view(2, 5)         # a view: nothing moves
        torch.mm(a.view(2, 5).t(), b.view(2, 5))   # (5, 2) @ (2, 5): reads 80, writes 100
    assert mode.ops == 2 and mode.bytes == 120 + 180
    assert mode.by_op == {"add": 120, "mm": 180} and mode.calls == {"add": 1, "mm": 1}


def test_attention_flops_are_per_segment():
    # segments of 3 and 5 rows, d 8: forward 4*8*(9+25), backward 2.5 times that
    assert attention_flops([0, 3, 8], 8) == int(3.5 * 4 * 8 * 34)
    assert attention_flops([0, 8], 8) > attention_flops([0, 3, 8], 8)   # one segment of 8 sees more


def test_kernel_summary_per_call_by_name():
    events = [{"cat": "kernel", "name": "gemm", "dur": 300.0}, {"cat": "kernel", "name": "gemm", "dur": 300.0},
              {"cat": "kernel", "name": "add", "dur": 50.0}, {"cat": "gpu_memcpy", "name": "copy", "dur": 20.0},
              {"cat": "cpu_op", "name": "aten::mm", "dur": 999.0}]   # host side: not GPU work
    s = kernel_summary(events, iters=2, top=2)
    assert s["kernels"] == 2.0 and abs(s["kernel_ms"] - 0.335) < 1e-12
    assert [k["name"] for k in s["top"]] == ["gemm", "add"] and s["top"][0] == {"name": "gemm", "calls": 1.0,
                                                                                 "ms": 0.3}
    text = table({"replayed": {"forward_ms": 1.0, "forward_host_ms": 0.1, "backward_ms": 2.0, "step_ms": 3.0,
                               "step_host_ms": 0.2, **s}},
                 {"ops": 10, "bytes": 3e9, "flops": 2e12, "copy_gb_s": 3000.0, "matmul_tflop_s": 800.0})
    assert "| replayed | 1.0 (0.1) | 2.0 | 3.0 (0.2) | 2 | 0.3 | 2.7 |" in text
    assert "moving 3.00 GB = 1.0 ms at the copy's 3,000 GB/s; 2.00 TFLOP of products and attention = 2.5 ms" in text


def test_the_tool_times_the_padded_blocks_on_the_cpu(tmp_path, capsys):
    encoder_gpu_time = import_tool("encoder_gpu_time")
    out = tmp_path / "encoder_time.json"
    conf = ROOT / "recipes" / "aishell" / "conf" / "bench_llm_heavy.yaml"
    assert encoder_gpu_time.main(["--config", str(conf), "--rows", "512", "--fill", "400", "--segments", "32",
                                  "--max_len", "256", "--repeats", "2", "--device", "cpu", "--compiled", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pos_enc relative -> wenet" in text or "pos_enc None -> wenet" in text
    assert "| eager, padded to the static shape |" in text and "| – | – | – |" in text and "replayed (train.encoder_graphs)" not in text
    res = json.loads(out.read_text())
    assert res["real_rows"] == 400 and res["rows"] == 512 and res["floors"]["ops"] > 0
    top = res["floors"]["top_ops"]   # the operators moving most bytes, largest first, in the table too
    assert len(top) == 8 and top[0]["bytes"] >= top[-1]["bytes"] and sum(o["bytes"] for o in top) <= res["floors"]["bytes"]
    assert f"| {top[0]['op']} | {top[0]['calls']:,} |" in text
    eager = res["variants"]["eager, padded to the static shape"]
    assert eager["step_ms"] > 0 and eager["forward_ms"] > 0 and res["floors"]["flops"] > 0
    assert "| compiled |" in text and res["variants"]["compiled"]["forward_ms"] > 0   # inductor on the CPU
    # the depthwise convolution alone over the replay's buffer: 512 rows and 3 zeros (kernel 7) between 32 slots
    assert "| depthwise convolution over (1, 64, 605), float32 |" in text
    assert set(res["depthwise"]) == {"convolution kernel", "shifted products"}


def test_depthwise_forms_agree_and_are_timed():
    from west.lab.encoder_time import depthwise_times

    conv = torch.nn.Conv1d(16, 16, 7, groups=16)
    times = depthwise_times(conv, 50, torch.float32, repeats=2)
    # timed, not compared: on a shared 2-core machine one forward can outlast a whole step
    assert set(times) == {"convolution kernel", "shifted products"}
    assert all(0 < v[k] < float("inf") for v in times.values() for k in ("forward_ms", "step_ms"))
    assert times["shifted products"]["max_abs_diff"] < 1e-5


def test_eager_blocks_run_eagerly_where_a_capture_replaced_the_stacks_forward():
    """make_graphed_callables replaces a captured module's forward with the replay; the tool's eager
    rows call the blocks' own forward (on the seventh GPU run they were replays)."""
    import yaml

    from west.lab.encoder_time import eager_blocks
    from west.models.config import ConformerConfig
    from west.models.conformer import ConformerEncoder

    tool = import_tool("encoder_gpu_time")
    torch.manual_seed(0)
    conf = ROOT / "recipes" / "aishell" / "conf" / "bench_llm_heavy.yaml"
    section = {**yaml.safe_load(conf.read_text())["model"]["encoder"], "pos_enc": "wenet", "attn_backend": "varlen",
               "attn_dropout": 0.0, "dropout": 0.0}
    encoder = ConformerEncoder(ConformerConfig.from_dict(section)).train()
    lens = tool.lengths(200, 64)
    rows = torch.randn(sum(lens), encoder.output_dim)
    static, args = tool.padded(encoder, tool.planned_shape(256, 0, 0, lens), "fp32", rows, lens)
    want = static.stack(*args)

    def replay(*a):
        raise AssertionError("the replay ran")
    static.stack.forward = replay   # what a capture does to the module
    torch.testing.assert_close(eager_blocks(static, args), want, rtol=0, atol=0)
