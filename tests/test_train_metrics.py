"""Step records, train_log.jsonl / TensorBoard / audit files, resume truncation, epoch totals,
the profiler option, and the GPU/CPU samplers (NVML through a fake pynvml module)."""
from __future__ import annotations

import json
import math
import sys
import threading
import time
import types

import pytest
import torch

from west.batch import COUNTER_NAMES
from west.lab.host_clock import HOST_KEYS
from west.train import gpu_monitor as G
from west.train.metrics import AllocatorEvents, EpochTotals, MetricsLogger, peak_memory_mb, step_record, truncate_jsonl
from west.train.profiling import build_profiler
from west.train.step import StepResult

COUNTS = {"utterances": 6, "label_tokens": 50, "real_llm_tokens": 300, "computed_llm_tokens": 400,
          "real_enc_frames": 900, "computed_enc_frames": 1000}


def result(status="ok", loss=2.0):
    return StepResult(status, loss, loss * 50, 50, 10, 1.5, 1e-3, dict(COUNTS))


def test_step_record_fields_and_rates():
    rec = step_record(3, 1, result(), wall_s=2.0, peak_mem_mb=123.0, hw={"cpu_util_pct": 50.0})
    assert {"step", "epoch", "loss", "lr", "grad_norm", "step_time_s", "utts_per_s", "tokens_per_s",
            "peak_mem_mb", "cpu_util_pct", *COUNTER_NAMES} <= set(rec)
    assert rec["utts_per_s"] == 3.0 and rec["tokens_per_s"] == 150.0
    assert rec["llm_fill"] == 0.75 and rec["enc_fill"] == 0.9 and rec["acc"] == 0.2
    assert "launch_s" not in rec   # not measured (an empty step): left out, not written as null
    timed = StepResult("ok", 2.0, 100.0, 50, 10, 1.5, 1e-3, dict(COUNTS), launch_s=0.25, sync_wait_s=0.01,
                       update_s=0.02)
    rec = step_record(3, 1, timed, wall_s=2.0, peak_mem_mb=123.0)
    assert (rec["launch_s"], rec["sync_wait_s"], rec["update_s"]) == (0.25, 0.01, 0.02)


def test_logger_files_tensorboard_audit_and_truncation(tmp_path):
    log = MetricsLogger(tmp_path, rank=0, tensorboard=True, progress_bar=True, audit=True)
    for step in (1, 2, 3):
        log.log_step(step_record(step, 0, result(loss=math.nan if step == 2 else 1.0), 1.0, 1.0))
        log.log_audit(step, 0, [f"k{step}a", f"k{step}b"])
    totals = EpochTotals()
    totals.add({"status": "ok", "label_tokens": 50, "step_time_s": 1.0, **COUNTS}, 100.0)
    totals.add({"status": "nonfinite", "label_tokens": 50, "step_time_s": 1.0, **COUNTS}, math.nan)
    log.log_epoch(totals.summary(0, {"too_long": 3}))
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and lines[1]["loss"] is None
    epoch = json.loads((tmp_path / "epochs.jsonl").read_text())
    assert epoch["steps"] == 2 and epoch["skipped_steps"] == 1 and epoch["loss"] == 2.0
    assert epoch["skipped_inputs"] == {"too_long": 3} and epoch["utterances"] == 12
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    audit = [json.loads(x) for x in (tmp_path / "audit" / "rank0.jsonl").read_text().splitlines()]
    assert audit[2] == {"step": 3, "epoch": 0, "keys": ["k3a", "k3b"]}

    # A resumed run from step 1 drops lines 2-3 (and a torn last line) before appending.
    with open(tmp_path / "train_log.jsonl", "a") as f:
        f.write('{"step": 4, "lo')
    again = MetricsLogger(tmp_path, rank=0, start_step=1, tensorboard=False, progress_bar=False, audit=True)
    again.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "train_log.jsonl").read_text().splitlines()] == [1]
    assert len((tmp_path / "audit" / "rank0.jsonl").read_text().splitlines()) == 1


def test_non_main_rank_writes_only_its_audit(tmp_path):
    log = MetricsLogger(tmp_path, rank=1, audit=True)
    log.log_step(step_record(1, 0, result(), 1.0, 1.0))
    log.log_audit(1, 0, ["x"])
    log.close()
    assert not (tmp_path / "train_log.jsonl").exists()
    assert (tmp_path / "audit" / "rank1.jsonl").read_text().count("\n") == 1


def test_truncate_missing_file_is_noop(tmp_path):
    truncate_jsonl(tmp_path / "none.jsonl", 3)
    assert not (tmp_path / "none.jsonl").exists()


def test_epoch_totals_state_round_trip():
    t = EpochTotals()
    t.add({"status": "ok", "label_tokens": 50, "step_time_s": 1.0, **COUNTS}, 100.0)
    t2 = EpochTotals()
    t2.load_state_dict(json.loads(json.dumps(t.state_dict())))
    assert t2.summary(0) == t.summary(0)


def test_allocator_events_are_per_read_deltas_of_the_cumulative_counters():
    """torch.cuda.memory_stats counts from process start; each read gives what happened since the
    last one, under train_log names; a counter this torch lacks is left out, not read as 0."""
    stats = {"num_device_alloc": 40, "num_device_free": 2, "num_alloc_retries": 0, "num_ooms": 0}
    events = AllocatorEvents(torch.device("cuda"), stats=lambda: dict(stats))
    assert events.read() == {"device_allocs": 0, "device_frees": 0, "alloc_retries": 0}
    stats.update(num_device_alloc=43, num_device_free=5, num_alloc_retries=1)
    assert events.read() == {"device_allocs": 3, "device_frees": 3, "alloc_retries": 1}
    assert events.read() == {"device_allocs": 0, "device_frees": 0, "alloc_retries": 0}
    old_torch = AllocatorEvents(torch.device("cuda"), stats=lambda: {"num_alloc_retries": 7})
    assert old_torch.read() == {"alloc_retries": 0}
    assert AllocatorEvents(torch.device("cpu")).read() == {}


def test_peak_memory_cpu():
    assert peak_memory_mb(torch.device("cpu")) > 1.0


def test_peak_reserved_is_read_on_cuda_only(monkeypatch):
    """What the allocator held at most (a smaller card's question), in MiB; nothing off CUDA."""
    from west.train.metrics import peak_reserved_mb

    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 3 * 2**30)
    assert peak_reserved_mb(torch.device("cuda")) == {"peak_reserved_mb": 3072.0}
    assert peak_reserved_mb(torch.device("cpu")) == {}


def test_profiler_option_writes_a_trace(tmp_path):
    with build_profiler(False, tmp_path) as off:
        off.step()
    assert not (tmp_path / "profile").exists()
    with build_profiler(True, tmp_path, "cpu", wait=0, active=1) as prof:
        for _ in range(3):
            torch.ones(8, 8) @ torch.ones(8, 8)
            prof.step()
    assert list((tmp_path / "profile").glob("*.json*"))


# ----------------------------------------------------------------------------- monitors

def fake_pynvml(busy=(30, 90), mem_used_mb=(100, 300)):
    """The few pynvml calls the sampler makes, replaying fixed readings."""
    calls = {"init": 0, "shutdown": 0, "by_uuid": [], "by_index": []}
    state = {"i": 0}

    def util(handle):
        i = state["i"] % len(busy)
        return types.SimpleNamespace(gpu=busy[i], memory=busy[i] // 2)

    def mem(handle):
        i = state["i"] % len(busy)
        state["i"] += 1
        return types.SimpleNamespace(used=mem_used_mb[i] * 2**20, total=2**34)

    def by_uuid(uuid):
        calls["by_uuid"].append(uuid)
        return ("h", uuid)

    mod = types.SimpleNamespace(
        nvmlInit=lambda: calls.__setitem__("init", calls["init"] + 1),
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetHandleByIndex=lambda i: calls["by_index"].append(i) or ("h", i),
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetUtilizationRates=util,
        nvmlDeviceGetMemoryInfo=mem)
    return mod, calls


def test_nvml_sampler_windows_with_fake_module():
    mod, calls = fake_pynvml()
    s = G.NvmlSampler(device_index=1, nvml=mod, uuid="GPU-abc")
    s.start(thread=False)  # start takes one sample (30 %, 100 MiB)
    s.sample()             # (90 %, 300 MiB)
    first = s.read()
    assert first == {"gpu_busy_pct": 60.0, "gpu_mem_busy_pct": 30.0, "gpu_mem_used_mb": 300.0, "gpu_samples": 2.0}
    assert s.read() == {}  # a new window starts empty
    s.sample()
    assert s.read()["gpu_busy_pct"] == 30.0
    s.stop()
    assert calls["by_uuid"] == ["GPU-abc"] and calls["by_index"] == [] and calls["shutdown"] == 1


def test_nvml_sm_samples_are_windowed_by_timestamp():
    mod, _ = fake_pynvml()
    log = [(5, 10.0), (7, 20.0), (12, 80.0), (15, 60.0), (20, 40.0)]   # (timestamp, smUtil) the driver holds
    seen = []
    now = {"t": 7}

    def proc_util(handle, last):
        seen.append(last)
        return [types.SimpleNamespace(timeStamp=t, smUtil=u) for t, u in log if last < t <= now["t"]]

    mod.nvmlDeviceGetProcessUtilization = proc_util
    s = G.NvmlSampler(nvml=mod)
    s.start(thread=False)          # samples up to t=7 predate the window
    now["t"] = 15
    s.sample()
    assert s.read()["gpu_sm_pct"] == 70.0
    now["t"] = 20
    s.sample()
    assert s.read()["gpu_sm_pct"] == 40.0
    assert seen == [0, 7, 15]
    s.stop()


def test_reading_the_window_never_waits_for_an_nvml_call_in_progress():
    """read() runs on the launching thread once per step; the sampler's NVML queries can take
    milliseconds in the driver, so they run before the sampler takes the lock read() needs."""
    mod, _ = fake_pynvml()
    entered, release = threading.Event(), threading.Event()

    def slow_proc_util(handle, last):
        entered.set()
        release.wait(10)
        return [types.SimpleNamespace(timeStamp=last + 1, smUtil=50.0)]

    s = G.NvmlSampler(nvml=mod)
    s._handle = ("h", 0)
    mod.nvmlDeviceGetProcessUtilization = slow_proc_util
    sampler = threading.Thread(target=s.sample, daemon=True)
    sampler.start()
    assert entered.wait(10)                    # the sampler is inside the driver's call
    reader = threading.Thread(target=s.read, daemon=True)
    reader.start()
    reader.join(2)
    still_waiting = reader.is_alive()
    release.set()
    sampler.join(10)
    assert not still_waiting
    assert s.read() == {"gpu_busy_pct": 30.0, "gpu_mem_busy_pct": 15.0, "gpu_mem_used_mb": 100.0,
                        "gpu_samples": 1.0, "gpu_sm_pct": 50.0}


def test_nvml_sampler_thread_and_index_fallback():
    mod, calls = fake_pynvml()
    mod.nvmlDeviceGetHandleByUUID = lambda u: (_ for _ in ()).throw(RuntimeError("unknown uuid"))
    s = G.NvmlSampler(device_index=2, interval_s=0.01, nvml=mod, uuid="GPU-x")
    s.start()
    deadline = time.monotonic() + 10
    while s._n < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.stop()
    out = s.read()
    assert out["gpu_samples"] >= 3 and 30.0 <= out["gpu_busy_pct"] <= 90.0
    assert calls["by_index"] == [2]


def test_build_monitor_choices(monkeypatch):
    assert isinstance(G.build_monitor("cpu"), G.CpuSampler)
    assert isinstance(G.build_monitor("cuda", nvml=False), G.CpuSampler)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed -> warn, CPU sampler
    with pytest.warns(UserWarning, match="pynvml not installed"):
        assert isinstance(G.build_monitor("cuda"), G.CpuSampler)
    mod, _ = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    assert isinstance(G.build_monitor("cuda"), G.NvmlSampler)


def test_cpu_sampler_interface():
    s = G.CpuSampler()
    s.start()
    sum(i * i for i in range(200_000))
    out = s.read()
    s.stop()
    assert set(out) - set(HOST_KEYS) == {"cpu_util_pct", "cpu_count"} and out["cpu_util_pct"] >= 0
    n = G.NullMonitor()
    n.start()
    assert n.read() == {}
