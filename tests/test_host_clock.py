"""west.lab.host_clock: the hypervisor's steal and the cgroup's throttling, read from fake /proc and
cgroup trees (v1 and v2) and from this machine's own where Linux has them; the launching thread's
figures per window."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from west.lab.host_clock import HOST_KEYS, HostWindow, MachineClock, MachineTimes, cpu_cgroup, describe, host_line, main

TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parents[1]


def fake_proc(tmp_path: Path, cgroup_lines: str, steal_ticks: int = 7) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    # user nice system idle iowait irq softirq steal guest guest_nice: steal is the 8th figure
    (proc / "stat").write_text(f"cpu  10 0 20 300 4 0 5 {steal_ticks} 0 0\ncpu0 5 0 10 150 2 0 2 3 0 0\nintr 1 2 3\n")
    return proc


def test_cgroup_v2_quota_throttling_and_steal_are_read(tmp_path):
    proc = fake_proc(tmp_path, "0::/\n", steal_ticks=7)
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "cpu.max").write_text("200000 100000\n")
    (root / "cpu.stat").write_text("usage_usec 99\nnr_periods 40\nnr_throttled 3\nthrottled_usec 1500\n")
    clock = MachineClock(proc, root)
    assert clock.quota_cores == 2.0
    assert clock.read() == MachineTimes(steal_ns=7 * TICK_NS, throttled_ns=1_500_000, throttles=3)
    (root / "cpu.max").write_text("max 100000\n")
    assert MachineClock(proc, root).quota_cores is None


def test_cgroup_v1_under_a_joint_mount_and_a_path_the_container_does_not_show(tmp_path):
    proc = fake_proc(tmp_path, "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n0::/\n")
    root = tmp_path / "cg"
    mount = root / "cpu,cpuacct"
    mount.mkdir(parents=True)   # /docker/abc is not there inside the container: the mount's root is its cgroup
    (mount / "cpu.cfs_quota_us").write_text("400000\n")
    (mount / "cpu.cfs_period_us").write_text("100000\n")
    (mount / "cpu.stat").write_text("nr_periods 9\nnr_throttled 2\nthrottled_time 5000000\n")
    assert cpu_cgroup(proc, root) == (mount, 1)
    clock = MachineClock(proc, root)
    assert clock.quota_cores == 4.0
    assert clock.read() == MachineTimes(steal_ns=7 * TICK_NS, throttled_ns=5_000_000, throttles=2)
    (mount / "docker" / "abc").mkdir(parents=True)   # where the path is there, it wins
    (mount / "docker" / "abc" / "cpu.stat").write_text("nr_periods 1\nnr_throttled 1\nthrottled_time 7\n")
    (mount / "docker" / "abc" / "cpu.cfs_quota_us").write_text("-1\n")
    (mount / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
    clock = MachineClock(proc, root)
    assert clock.quota_cores is None and clock.read().throttled_ns == 7


def test_nothing_to_read_gives_none_and_says_so(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    clock = MachineClock(proc, tmp_path / "none")
    assert clock.read() == MachineTimes(None, None, None)
    assert not {"steal_ms", "throttled_ms"} & set(HostWindow(clock).read())
    line = describe(None, clock.read())
    assert "no CPU quota" in line and "steal not known" in line and "throttled not known" in line


def test_a_window_gives_what_accrued_since_the_last_read_in_ms():
    readings = iter([MachineTimes(10_000_000, 0, 0), MachineTimes(13_000_000, 2_500_000, 1),
                     MachineTimes(13_000_000, 2_500_000, 1)])

    class Clock:
        def read(self):
            return next(readings)

    window = HostWindow(Clock())
    machine = ("steal_ms", "throttled_ms")
    assert {k: v for k, v in window.read().items() if k in machine} == {"steal_ms": 3.0, "throttled_ms": 2.5}
    assert {k: v for k, v in window.read().items() if k in machine} == {"steal_ms": 0.0, "throttled_ms": 0.0}
    total = MachineTimes(1, 2, 3).plus(MachineTimes(10, None, 30))
    assert total == MachineTimes(11, None, 33)
    assert MachineTimes.zero().plus(total) == total and MachineTimes.zero() == MachineTimes(0, 0, 0)


def test_describe_gives_cpu_seconds_and_the_share_of_all_cpus():
    cpus = os.cpu_count() or 1
    line = describe(1.5, MachineTimes(steal_ns=cpus * 500_000_000, throttled_ns=250_000_000, throttles=4), seconds=10.0)
    assert line.startswith(f"a CPU quota of 1.5 cores, {cpus} CPUs")
    assert f"steal {cpus * 0.5:.2f} CPU-s (5.0 % of the CPUs' time)" in line
    assert "cgroup throttled 0.25 CPU-s in 4 periods" in line


def test_the_command_line_writes_a_reading_and_prints_what_accrued(tmp_path, capsys):
    reading = tmp_path / "r.json"
    main([str(reading)])
    start = json.loads(reading.read_text())
    assert set(start) == {"steal_ns", "throttled_ns", "throttles", "wall"}
    main(["--since", str(reading)])
    assert "CPUs; steal" in capsys.readouterr().out
    out = subprocess.run([sys.executable, "-m", "west.lab.host_clock"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip().endswith("(since boot)")


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux only")
def test_the_observer_reports_the_machines_share_per_step_and_the_samplers_do_not():
    """The host clock is the lab's west-train observer; the product's CPU sampler reads no host clock."""
    from west.lab.host_clock import HostClockObserver
    from west.train.gpu_monitor import CpuSampler

    observer = HostClockObserver()
    assert observer.step_record() == {}   # no step yet
    with observer.around_step(None, None):
        pass
    assert observer.step_record()["steal_ms"] >= 0.0
    sampler = CpuSampler()
    sampler.start()
    assert not set(sampler.read()) & set(HOST_KEYS)


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="Linux's per-thread figures")
def test_a_window_read_on_its_thread_splits_that_threads_time_and_elsewhere_gives_the_machines_only():
    import threading
    import time

    window = HostWindow()
    stop = time.thread_time() + 0.03
    while time.thread_time() < stop:   # 30 ms of this thread's own clock
        pass
    f = window.read()
    assert set(f) <= set(HOST_KEYS) and f["host_cpu_ms"] >= 29 and f["host_runqueue_ms"] >= 0, f
    assert 0 <= f["host_kernel_ms"] <= f["host_cpu_ms"] and f["host_faults"] >= 0 and f["host_switches"] >= 0, f
    for _ in range(3):   # blocking three times: three voluntary switches at least
        time.sleep(0.002)
    assert window.read()["host_switches"] >= 3
    assert f["autograd_cpu_ms"] == 0.0   # a CPU backward runs on the calling thread: no pt_autograd threads
    line = host_line(f)
    assert line.startswith(f"the launching thread {f['host_cpu_ms']:.1f} on a core (") and "waiting for one" in line
    assert "taken by the machine: the hypervisor's steal (all CPUs) " in line
    elsewhere = []
    reader = threading.Thread(target=lambda: elsewhere.append(window.read()))
    reader.start()
    reader.join()
    assert "host_cpu_ms" not in elsewhere[0] and "steal_ms" in elsewhere[0]
    assert host_line({}) == ""
