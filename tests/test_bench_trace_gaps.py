"""west.lab.trace_gaps on synthetic Chrome traces shaped like a CUDA profile (a GPU run is not
possible here), and tools/profile_step.py end to end on the CPU."""
from __future__ import annotations

import json

import pytest

from west.lab.trace_gaps import FORWARD_OTHER, REST, Innermost, analyse, kernel_timeline, table, timeline_table, union

from helpers.e2e import import_tool


def X(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def launch(corr, ts, tid=1):
    return X("cuda_runtime", "cudaLaunchKernel", ts, 2, tid, correlation=corr)


def kernel(corr, ts, dur):
    return X("kernel", f"k{corr}", ts, dur, tid=7, correlation=corr)


def one_step(t0: float) -> list[dict]:
    """A 1000 us step: encoder [0,200), LLM [200,380), other forward to 400, backward on another
    thread, optimizer [900,950); four kernels, each launched inside one aten op."""
    ev = [X("user_annotation", "west:step", t0, 1000), X("user_annotation", "west:forward", t0, 400),
          X("user_annotation", "west:forward/encoder", t0, 200), X("user_annotation", "west:forward/llm", t0 + 200, 180),
          X("user_annotation", "west:optimizer", t0 + 900, 50),
          X("cpu_op", "aten::mm", t0 + 5, 10), launch(1, t0 + 10), kernel(1, t0 + 20, 80),
          X("cpu_op", "aten::linear", t0 + 240, 20), X("cpu_op", "aten::addmm", t0 + 245, 10),
          launch(2, t0 + 250), kernel(2, t0 + 300, 50),
          X("cpu_op", "aten::mul", t0 + 590, 15, tid=2), launch(3, t0 + 600, tid=2), kernel(3, t0 + 610, 190),
          X("cpu_op", "aten::_fused_adamw_", t0 + 915, 10), launch(4, t0 + 920), kernel(4, t0 + 930, 10)]
    return [{**e, "args": dict(e["args"], correlation=e["args"]["correlation"] + int(t0))} if "correlation" in e["args"]
            else e for e in ev]


def test_kernel_timeline_splits_idle_into_host_late_and_queued_gaps():
    """A kernels-only trace: k2 was queued before the GPU went idle (a 10 us gap: queued), k3 and k4
    were launched after (200 and 2000 us: the host was late), k5 has no launch record; a cudaFree
    sits inside the longest gap, a cudaStreamSynchronize at the start of the gap before k5."""
    ev = [launch(1, -20), kernel(1, 0, 100), launch(2, 50), kernel(2, 110, 90), launch(3, 350), kernel(3, 400, 100),
          X("cuda_runtime", "cudaFree", 600, 1800), launch(4, 2450), kernel(4, 2500, 100),
          X("cuda_runtime", "cudaStreamSynchronize", 2600, 10), kernel(99, 2700, 10)]
    res = kernel_timeline(ev, steps=2)
    assert res["window_ms"] == pytest.approx(2.71) and res["step_ms"] == pytest.approx(1.355)
    assert res["gpu_busy_pct"] == pytest.approx(100 * 400 / 2710)
    assert res["gpu_ops_per_step"] == 2.5 and res["gaps_per_step"] == 2.0 and res["launch_calls_per_step"] == 2.0
    assert res["idle_ms_per_step"] == pytest.approx({"host late": 1.1, "queued": 0.005, "unattributed": 0.05})
    by_length = res["gaps_by_length"]                         # 10 | 200, 100 | 2000 us
    assert [g["gaps_per_step"] for g in by_length] == [0, 0.5, 1.0, 0.5]
    assert [g["idle_ms_per_step"] for g in by_length] == pytest.approx([0, 0.005, 0.15, 1.0])
    calls = {c["call"]: c for c in res["runtime_calls"]}
    assert calls["cudaFree"] == pytest.approx({"call": "cudaFree", "calls_per_step": 0.5, "ms_per_step": 0.9,
                                               "idle_overlap_ms_per_step": 0.9})
    assert calls["cudaStreamSynchronize"]["idle_overlap_ms_per_step"] == pytest.approx(0.005)   # 10 of k4-k5's gap
    assert [(g["idle_us"], g["kind"], g["after"], g["before"]) for g in res["longest_gaps"]] == [
        (2000, "host late", "k3", "k4"), (200, "host late", "k2", "k3"), (100, "unattributed", "k4", "k99"),
        (10, "queued", "k1", "k2")]
    text = timeline_table(res)
    assert "idle per step: host late 1.1 ms, queued 0.0 ms, unattributed 0.1 ms" in text
    assert "| 1000 us - 1000 us" not in text and "| >= 1000 us | 0.5 | 1.00 |" in text
    assert "| cudaFree | 0.5 | 0.90 | 0.90 |" in text and "| 2000 | host late | k3 | k4 |" in text
    # k1..k99 name no known kind: all of their 0.2 ms per step is elementwise work
    assert res["by_category"] == {"elementwise and reductions": {"kernels_per_step": 2.5, "ms_per_step": 0.2}}
    assert "| elementwise and reductions | 2 | 0.2 | – | – |" in text
    with pytest.raises(ValueError, match="no GPU events"):
        kernel_timeline([launch(1, 0)], steps=1)


def test_union_and_innermost():
    assert union([(5, 7), (0, 2), (1, 3), (7, 9)]) == [(0, 3), (5, 9)]
    rng = Innermost([(0, 100, "a"), (0, 8, "e"), (10, 50, "b"), (20, 30, "c"), (60, 70, "d")])
    assert [rng.at(t) for t in (5, 9, 15, 25, 35, 65, 80, 200)] == ["e", "a", "b", "c", "b", "d", "a", None]


@pytest.mark.parametrize("steps", [1, 2])
def test_busy_phases_and_gaps_are_charged_to_the_launch_that_ended_them(steps):
    events = [e for i in range(steps) for e in one_step(2000.0 * i)]
    res = analyse(events)
    assert res["steps"] == steps
    if steps == 1:
        assert res["gpu_busy_pct"] == pytest.approx(33.0)          # 80 + 50 + 190 + 10 of 1000 us
    host = res["host_ms_per_step"]
    between = {"outside a step": 0.5} if steps == 2 else {}   # 1000 us between the two steps
    assert host == pytest.approx({"forward/encoder": 0.2, "forward/llm": 0.18, FORWARD_OTHER: 0.02,
                                  "optimizer": 0.05, REST: 0.55, **between})
    assert sum(host.values()) == pytest.approx(res["step_ms"])   # the phases tile the window
    ph = res["phases"]
    assert {k: v["gpu_ops_per_step"] for k, v in ph.items()} == {"forward/encoder": 1, "forward/llm": 1, REST: 1,
                                                                   "optimizer": 1}
    assert ph[REST]["gpu_ms_per_step"] == pytest.approx(0.19)
    if steps == 1:
        idle = {k: v["idle_ms_per_step"] for k, v in ph.items()}
        # gaps [0,20) encoder, [100,300) llm, [350,610) backward, [800,930) optimizer, tail [940,1000)
        assert idle == pytest.approx({"forward/encoder": 0.02, "forward/llm": 0.2, REST: 0.26 + 0.06,
                                      "optimizer": 0.13})
        by_op = {r["op"]: r["idle_ms_per_step"] for r in res["idle_by_op"]}
        assert by_op == pytest.approx({"aten::mul": 0.26, "aten::addmm": 0.2, "aten::_fused_adamw_": 0.13,
                                       "end of step (host)": 0.06, "aten::mm": 0.02})
        assert sum(idle.values()) + res["gpu_busy_pct"] / 100 * res["step_ms"] == pytest.approx(res["step_ms"])
    assert "| forward/llm |" in table(res) and "| aten::mul |" in table(res)


def test_a_trace_without_steps_is_refused_and_one_without_gpu_events_gives_host_times():
    with pytest.raises(ValueError, match="west:step"):
        analyse([X("cpu_op", "aten::mm", 0, 10)])
    res = analyse([e for e in one_step(0.0) if e["cat"] not in ("kernel", "cuda_runtime")])
    assert res["gpu_busy_pct"] is None and res["phases"] == {} and res["host_ms_per_step"][REST] == pytest.approx(0.55)
    assert "n/a (no GPU events)" in table(res)


def test_profile_step_runs_the_production_step_on_the_cpu(tmp_path, corpus, capsys):
    from helpers.e2e import bench_setup

    profile_step = import_tool("profile_step")
    llm, conf = bench_setup(tmp_path, corpus["texts"].values())
    out = tmp_path / "profile.json"
    rc = profile_step.main(["--config", str(conf), "--model.llm.path", str(llm), "--data", str(corpus["list"]),
                            "--num_utts", str(len(corpus["texts"])), "--modes", "static,pack", "--batch_size", "4",
                            "--pack_tokens", "1024", "--steps", "2", "--warmup_steps", "1", "--out", str(out),
                            "--trace_dir", str(tmp_path / "traces")])
    assert rc == 0
    res = json.loads(out.read_text(encoding="utf-8"))
    assert res["device"] == "cpu" and set(res["modes"]) == {"static", "pack"}
    for mode, r in res["modes"].items():
        assert r["steps"] == 2 and r["gpu_busy_pct"] is None
        host = r["host_ms_per_step"]
        assert {"forward/encoder", "forward/projector", "forward/llm", REST, "optimizer"} <= set(host)
        assert sum(host.values()) == pytest.approx(r["step_ms"])   # phases (and the gaps between steps) tile
        assert host["forward/encoder"] > 0 and host[REST] > 0
        assert (tmp_path / "traces" / f"{mode}.json").is_file()
    kernels = profile_step.main(["--config", str(conf), "--model.llm.path", str(llm), "--data", str(corpus["list"]),
                                 "--num_utts", "4", "--modes", "pack", "--kernels_only"])
    assert kernels == 2 and "--kernels_only needs a CUDA device" in capsys.readouterr().out
    marks = profile_step.main(["--config", str(conf), "--model.llm.path", str(llm), "--data", str(corpus["list"]),
                               "--num_utts", "6", "--modes", "pack", "--pack_tokens", "1024", "--steps", "2",
                               "--warmup_steps", "1", "--out", str(out), "--phase_marks", "--single_thread_backward",
                               "--op_times"])
    assert marks == 0   # unprofiled steps marked at the phase boundaries, then timed by operator; nothing else
    pack = json.loads(out.read_text(encoding="utf-8"))["modes"]["pack"]
    assert set(pack) == {"phase_marks", "op_times"} and pack["phase_marks"]["steps"] == 2
    assert pack["op_times"]["steps"] == 1 and [p["phase"] for p in pack["op_times"]["phases"]][1] == "projector"
    assert [p["phase"] for p in pack["phase_marks"]["phases"]][2:4] == ["encoder forward", "encoder rows"]
    text = capsys.readouterr().out
    assert "| LLM backward |" in text and "backward on the launching thread, unprofiled" in text
    assert "the host's time by operator" in text and "host ms per step in pack: encoder rows" in text
    import torch
    assert torch.autograd.is_multithreading_enabled()   # the tool's setting ended with its steps
