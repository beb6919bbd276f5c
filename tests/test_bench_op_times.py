"""west.lab.op_times and tools/train_op_times.py: the host's time in a few phases of a real step,
operator by operator and between operators, by line; a slow operator and slow Python told apart."""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from west.lab.host_clock import MachineTimes, ThreadTimes, others_since
from west.lab.op_times import WATCHED, PhaseOpTimes, python_lock_suspects, table
from west.train.step import plan_step, train_step

from helpers.e2e import import_tool
from helpers.speech import packed_batch, samples, tiny_model


@torch.library.custom_op("west_test::slow_identity", mutates_args=())
def slow_identity(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.03)   # an operator that holds the host: a blocking allocation or wait, say
    return x.clone()


@slow_identity.register_fake
def _(x):
    return torch.empty_like(x)


slow_identity.register_autograd(lambda ctx, grad: grad)


def _step(model, batch, timer: PhaseOpTimes, opt=None):
    opt = opt or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with timer.hooks(model, opt):
        train_step(model, [batch], plan_step([batch], 1), opt, sched, device=torch.device("cpu"), world_size=1,
                   grad_clip=1.0)


def _phase(res: dict, name: str) -> dict:
    return next(p for p in res["phases"] if p["phase"] == name)


def test_a_real_step_is_timed_in_its_watched_phases_by_line_and_leaves_nothing_behind():
    model, batch = tiny_model(), packed_batch(samples(), 256)
    timer = PhaseOpTimes()
    _step(model, batch, timer)
    _step(model, batch, timer)
    res = timer.summary(skip=1)
    assert res["steps"] == 1 and [p["phase"] for p in res["phases"]] == list(WATCHED)
    proj = _phase(res, "projector")
    ops = {(e["name"], e["where"].split(":")[0]) for e in timer_entries(timer, "projector", "operator")}
    assert ("aten.addmm", "west/models/projector.py") in ops       # the MLP's products, at the projector's line
    assert ("aten.index_put", "west/models/speech_llm.py") in {(e["name"], e["where"].split(":")[0])
                                                               for e in timer_entries(timer, "splice", "operator")}
    assert proj["operators_per_step"] >= 4
    assert proj["operators_ms"] + proj["between_ms"] + proj["timer_ms"] == pytest.approx(proj["host_ms"], rel=1e-6)
    # nothing stays behind: no mode on the stack, no hooks; operators outside the phases were not timed
    assert torch._C._len_torch_dispatch_stack() == 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not any(k[0] not in WATCHED for step in timer.steps for k in step)


def timer_entries(timer: PhaseOpTimes, phase: str, kind: str) -> list[dict]:
    return [{"name": k[2], "where": k[3]} for step in timer.steps for k in step if k[0] == phase and k[1] == kind]


def test_a_slow_operator_and_slow_python_are_told_apart():
    model, batch = tiny_model(), packed_batch(samples(), 256)
    net = model.projector.net
    inner_forward = net.forward

    def slow_forward(x):
        time.sleep(0.02)                         # Python holding the host between two operators
        return inner_forward(slow_identity(x))   # then one operator that holds it for 30 ms
    net.forward = slow_forward
    timer = PhaseOpTimes(("projector",))
    _step(model, batch, timer)
    res = timer.summary(top=6)
    proj = _phase(res, "projector")
    # looked up, not ranked: on a loaded machine another operator of the step may also take 20 ms or more
    slow = next(e for e in proj["top"] if e["kind"] == "operator" and e["name"] == "west_test.slow_identity")
    assert slow["longest_ms"] >= 29
    # placed at the innermost line of west: the projector's call of its (here slowed) MLP
    assert slow["where"].startswith("west/models/projector.py:") and slow["calls_per_step"] == 1
    gap = next(e for e in proj["top"] if e["kind"] == "between" and e["where"] == slow["where"])
    assert gap["longest_ms"] >= 19
    assert proj["host_ms"] >= 49 and [p["phase"] for p in res["phases"]] == ["projector"]
    text = table(res)
    assert "**projector**: " in text and "| `west_test.slow_identity` |" in text and "| `Python before it` |" in text


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="Linux's per-thread scheduler figures")
def test_the_launching_threads_time_splits_into_on_a_core_and_blocked_and_other_threads_show():
    model, batch = tiny_model(), packed_batch(samples(), 256)
    go, done, leave = threading.Event(), threading.Event(), threading.Event()

    def burn():   # another thread on a core for 40 ms of its own clock (however busy the machine), alive until
        go.wait()   # the step's clocks are read
        stop = time.thread_time() + 0.04
        while time.thread_time() < stop:
            pass
        done.set()
        leave.wait()
    burner = threading.Thread(target=burn, name="west-test-burner", daemon=True)
    burner.start()
    inner_forward = model.projector.net.forward

    def forward(x):
        stop = time.perf_counter() + 0.03
        while time.perf_counter() < stop:   # the launching thread on a core (or waiting for one) for 30 ms
            pass
        go.set()
        done.wait()                          # then blocked for 40 ms while the burner runs
        return inner_forward(x)
    model.projector.net.forward = forward
    timer = PhaseOpTimes(("projector", "splice"))
    try:
        _step(model, batch, timer)
    finally:
        leave.set()
        burner.join()
    res = timer.summary()
    t = _phase(res, "projector")["thread"]
    assert t["cpu_ms"] + t["runqueue_ms"] >= 28 and t["blocked_ms"] >= 30 and t["voluntary_switches"] >= 1, t
    assert t["wall_ms"] >= 70 and t["cpu_ms"] + t["runqueue_ms"] + t["blocked_ms"] == pytest.approx(t["wall_ms"], abs=1), t
    others = {o["thread"]: o["cpu_ms_per_step"] for o in _phase(res, "projector")["others"]}
    assert others.get("west-test-burner", 0.0) >= 20, others   # found by its Python name
    splice = _phase(res, "splice")["thread"]
    assert splice["blocked_ms"] < 20, splice   # the splice did neither
    assert "the launching thread, means per step: " in table(res) and "`west-test-burner` " in table(res)
    # threads by name between two readings: one that started meanwhile counts from zero, one that ended is gone
    assert others_since({1: ("a", 5), 2: ("b", 9)}, {1: ("a", 8), 3: ("a", 4)}) == {"a": 7}
    # where a figure is unknown (no /proc: the CPU clock only), sums and differences stay unknown
    assert ThreadTimes(5, None, 1, 2).plus(ThreadTimes(1, 3, 1, 1)) == ThreadTimes(6, None, 2, 3)
    assert ThreadTimes(5, 4, 3, 2).since(ThreadTimes(1, 1, 1, 1)) == ThreadTimes(4, 3, 2, 1)


def test_python_lock_suspects_need_the_launching_thread_blocked_while_a_python_thread_ran():
    def phase(name, blocked, others):
        return {"phase": name, "thread": {"wall_ms": 30.0, "cpu_ms": 30.0 - blocked, "runqueue_ms": 0.0,
                                          "blocked_ms": blocked}, "others": others}
    pin = {"thread": "Thread-2 (_pin_memory_loop)", "cpu_ms_per_step": 12.0}
    omp = {"thread": "python (native)", "cpu_ms_per_step": 25.0}
    res = {"phases": [phase("projector", 24.0, [omp, pin]),        # blocked, a Python thread ran: suspect
                      phase("splice", 24.0, [omp]),                # blocked, only native threads ran
                      phase("loss", 3.0, [pin]),                   # not blocked
                      phase("encoder rows", 24.0, [dict(pin, cpu_ms_per_step=1.0)])]}   # the Python thread hardly ran
    assert python_lock_suspects(res) == [
        "projector: 24.0 of 30.0 ms blocked while `Thread-2 (_pin_memory_loop)` ran 12.0 ms"]
    assert python_lock_suspects({"phases": [{"phase": "splice"}]}) == []   # no thread figures: no verdict


def test_a_step_that_raises_in_a_watched_phase_leaves_no_mode_and_unknown_phases_are_refused():
    model, batch = tiny_model(), packed_batch(samples(), 256)

    def broken(*args, **kwargs):
        raise RuntimeError("projector broke")
    model.projector.net.forward = broken
    timer = PhaseOpTimes()
    with pytest.raises(RuntimeError, match="projector broke"):
        _step(model, batch, timer)
    assert torch._C._len_torch_dispatch_stack() == 0
    with pytest.raises(ValueError, match="unknown phases \\['projecter'\\]"):
        PhaseOpTimes(("projecter",))
    with pytest.raises(ValueError, match="no steps to summarize"):
        PhaseOpTimes().summary()


def test_train_op_times_times_every_step_of_a_real_west_train_run(tmp_path_factory, corpus, capsys):
    import west.train.loop as loop
    from west.bin.train import main as train_main

    from helpers.e2e import tiny_llm, train_argv, write_lists
    from helpers.threads import torch_threads

    tool = import_tool("train_op_times")
    d = tmp_path_factory.mktemp("op_times")
    lists = write_lists(corpus["rows"], d / "lists", 13)
    originals = {name: getattr(loop, name) for name in tool.STEP_FUNCTIONS}
    timer = PhaseOpTimes()
    argv = train_argv(tiny_llm(tmp_path_factory), lists.jsonl, d / "run", "--batch_type", "pack",
                      "--pack_tokens", "200", "--max_steps", "3", "--train.late_readback", "true")
    with torch_threads():
        assert tool.timed_run(train_main, argv, timer, loop) == 0
    assert len(timer.steps) == 3 and {name: getattr(loop, name) for name in tool.STEP_FUNCTIONS} == originals
    assert [p["phase"] for p in timer.summary(skip=1)["phases"]] == list(WATCHED)

    def failing(argv):
        raise SystemExit(7)
    with pytest.raises(SystemExit):
        tool.timed_run(failing, [], PhaseOpTimes(), loop)
    assert {name: getattr(loop, name) for name in tool.STEP_FUNCTIONS} == originals
    # the command line: the summary's tables and JSON
    out, md = d / "op_times.json", d / "op_times.md"
    interval = sys.getswitchinterval()
    try:
        with torch_threads():
            rc = tool.main(["--skip", "1", "--phases", "projector,splice", "--out", str(out), "--md", str(md),
                            "--switch_interval_ms", "0.5", "--",
                            *train_argv(tiny_llm(tmp_path_factory), lists.jsonl, d / "run2", "--batch_type", "pack",
                                        "--pack_tokens", "200", "--max_steps", "2")])
        assert rc == 0 and sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(interval)
    res = json.loads(out.read_text(encoding="utf-8"))
    assert res["train_rc"] == 0 and res["steps"] == 1 and [p["phase"] for p in res["phases"]] == ["projector", "splice"]
    assert res["switch_interval_ms"] == pytest.approx(0.5)
    text = md.read_text(encoding="utf-8")
    assert "**projector**: " in text and "(Python's switch interval: 0.5 ms)" in text
    with pytest.raises(SystemExit):
        tool.main(["--switch_interval_ms", "0"])
    assert sys.getswitchinterval() == interval


def test_each_phase_says_what_the_machine_took_while_it_ran():
    """The hypervisor's steal and the cgroup's throttling between a phase's two readings, per step:
    here a clock that advances 5 ms of steal and 2 ms of throttling per reading."""
    class Clock:
        n = 0

        def read(self):
            self.n += 1
            return MachineTimes(5_000_000 * self.n, 2_000_000 * self.n, self.n)

    model, batch = tiny_model(), packed_batch(samples(), 256)
    timer = PhaseOpTimes(("projector", "splice"))
    timer._machine = Clock()
    for _ in range(2):
        _step(model, batch, timer)
    res = timer.summary()
    for phase in ("projector", "splice"):
        t = _phase(res, phase)["thread"]
        assert (t["steal_ms"], t["throttled_ms"]) == (5.0, 2.0), t
    assert "taken by the machine: the hypervisor's steal (all CPUs) 5.0, the cgroup's throttling 2.0 ms" in table(res)


@pytest.mark.skipif(not Path("/dev/zero").exists() or sys.platform != "linux", reason="Linux's per-thread usage")
def test_time_in_the_kernel_and_page_faults_are_told_apart_from_the_threads_own_work():
    """A phase that spends its time in system calls and touches fresh pages (what pinning memory or a
    driver's ioctls do) says so in its thread line; a phase that does neither does not."""
    import mmap
    import os

    model, batch = tiny_model(), packed_batch(samples(), 256)
    inner_forward = model.projector.net.forward

    def forward(x):
        with open("/dev/zero", "rb", buffering=0) as f:   # 60 ms on a core, copying in the kernel
            stop = time.thread_time() + 0.06
            while time.thread_time() < stop:
                f.read(1 << 20)
        fresh = mmap.mmap(-1, 32 << 20)                    # 32 MiB never touched: a fault per page (or huge page)
        for at in range(0, len(fresh), os.sysconf("SC_PAGE_SIZE")):
            fresh[at] = 1
        fresh.close()
        return inner_forward(x)
    model.projector.net.forward = forward
    timer = PhaseOpTimes(("projector", "splice"))
    _step(model, batch, timer)
    res = timer.summary()
    proj, splice = _phase(res, "projector")["thread"], _phase(res, "splice")["thread"]
    assert proj["system_ms"] >= 20 and proj["page_faults"] >= 16, proj
    assert splice["system_ms"] < proj["system_ms"] and splice["page_faults"] < proj["page_faults"], splice
    assert "ms on a core (" in table(res) and " of them in the kernel, " in table(res)
