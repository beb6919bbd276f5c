"""The host's clocks: where a thread's wall time goes, what the process's other threads ran, and
what the machine took from the process.

A phase that takes the host 30 ms for a handful of operators (west-train's projector on an H200,
docs/notebook.md, run 8) is either working (slow code, slow launches, the kernel working for it), runnable
but without a core (contention: the loader's processes, torch's CPU threads), or blocked (a lock:
Python's or the driver's; a wait for the GPU in blocking mode; I/O). Linux keeps these apart per
thread: ``/proc/thread-self/schedstat`` holds the time spent waiting on a run queue; the thread's
resource usage its time in the kernel, page faults, voluntary (blocked) and involuntary
(preempted) context switches; its CPU clock the time on a core. The rest of the wall time the
thread was blocked. Other threads' time on a core in the same window says who ran meanwhile (a
Python thread there may hold the interpreter's lock).

Two things outside the process also read as blocked from inside it:

* **steal**: on a virtual machine the hypervisor runs something else on the vCPU. The guest kernel
  keeps the time out of the thread's clocks (paravirtual time accounting) and adds it up per CPU
  as ``steal`` in ``/proc/stat``;
* **throttling**: a container's cgroup with a CPU quota stops all its threads once the quota of a
  period (100 ms by default) is spent, until the next period; a process with many busy threads
  (torch's intra-op pool, loader workers) can spend 16 cores' quota in a few ms. The cgroup's
  ``cpu.stat`` counts the periods throttled and their time (v2 ``throttled_usec``, v1
  ``throttled_time``).

Every figure is read in tens of microseconds and only where Linux provides it; elsewhere None.
Standard library only: the training loop (:class:`HostWindow`, once per step), the benchmark, the
operator timer (west.lab.op_times) and ``tools/gpu_suite.sh`` (``python -m west.lab.host_clock``)
read the same figures.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import operator
import os
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

try:
    import resource
    _RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)   # Linux
except ImportError:   # Windows
    _RUSAGE_THREAD = None

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
_SELF = Path("/proc/thread-self")
_TASKS = Path("/proc/self/task")


class Counters:
    """Base of frozen dataclasses of counters, each an int or None where it is not known: a
    difference of two readings and a sum over steps keep None wherever either side has it."""

    def since(self, start):
        """What accrued from ``start`` to this reading."""
        return self._combine(start, operator.sub)

    def plus(self, other):
        """Both added up (per-phase figures over steps)."""
        return self._combine(other, operator.add)

    @classmethod
    def zero(cls):
        """Every counter at 0: the start of a sum."""
        return cls(*(0 for _ in fields(cls)))

    def _combine(self, other, op):
        pairs = ((getattr(self, f.name), getattr(other, f.name)) for f in fields(self))
        return type(self)(*(None if a is None or b is None else op(a, b) for a, b in pairs))


@dataclass(frozen=True)
class ThreadTimes(Counters):
    """One reading of the calling thread's clocks (ns) and context switches."""

    cpu_ns: int                     # on a core (CLOCK_THREAD_CPUTIME_ID: exact for the running thread)
    wait_ns: Optional[int]          # runnable, waiting on a run queue (schedstat's run_delay)
    voluntary: Optional[int]        # switches away because it blocked
    involuntary: Optional[int]      # switches away because it was preempted
    system_ns: Optional[int] = None   # of cpu_ns, in the kernel (system calls: the driver's ioctls, page faults)
    faults: Optional[int] = None      # page faults, minor and major (first touches of new memory, pinning)


def thread_times() -> ThreadTimes:
    """The calling thread's :class:`ThreadTimes` now (tens of microseconds)."""
    cpu = time.thread_time_ns()
    wait = voluntary = involuntary = system = faults = None
    try:
        wait = int((_SELF / "schedstat").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    if _RUSAGE_THREAD is not None:
        usage = resource.getrusage(_RUSAGE_THREAD)
        voluntary, involuntary = usage.ru_nvcsw, usage.ru_nivcsw
        system, faults = int(usage.ru_stime * 1e9), usage.ru_minflt + usage.ru_majflt
    return ThreadTimes(cpu, wait, voluntary, involuntary, system, faults)


def other_threads() -> dict[int, tuple[str, int]]:
    """Every other thread of this process: native id -> (name, ns on a core so far). Python threads
    by their ``threading`` name, the others by their kernel name and "(native)" (``pt_autograd_0
    (native)``; torch's OpenMP workers inherit the process's, ``python (native)``). Empty where
    ``/proc`` is not there. A running thread's figure lags by up to a scheduler tick, which averages
    out over steps."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    me = threading.get_native_id()
    out: dict[int, tuple[str, int]] = {}
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            tid = int(task.name)
            if tid == me:
                continue
            cpu = int((task / "schedstat").read_text().split()[0])
            name = names.get(tid) or _native_name(task, tid)
        except (OSError, ValueError, IndexError):
            continue   # a thread that ended meanwhile
        out[tid] = (name, cpu)
    return out


_NATIVE: dict[int, str] = {}   # thread id -> kernel name, read once (one file read less per thread and call)


def _native_name(task: Path, tid: int) -> str:
    if tid not in _NATIVE:
        _NATIVE[tid] = f"{(task / 'comm').read_text().strip()} (native)"
    return _NATIVE[tid]


def others_since(start: dict[int, tuple[str, int]], end: dict[int, tuple[str, int]]) -> dict[str, int]:
    """ns on a core per thread name between two :func:`other_threads` readings (threads of one name
    added up; a thread that started meanwhile counts from zero)."""
    out: dict[str, int] = {}
    for tid, (name, cpu) in end.items():
        ran = cpu - start.get(tid, (name, 0))[1]
        if ran > 0:
            out[name] = out.get(name, 0) + ran
    return out


@dataclass(frozen=True)
class MachineTimes(Counters):
    """One reading, in ns since boot (steal, all CPUs added up) or since the cgroup was made."""

    steal_ns: Optional[int]
    throttled_ns: Optional[int]
    throttles: Optional[int]       # periods in which the cgroup was throttled


def _steal_ns(proc: Path) -> Optional[int]:
    """All CPUs' steal from the first line of /proc/stat (``cpu user nice system idle iowait irq
    softirq steal ...``, in clock ticks)."""
    try:
        with open(proc / "stat", encoding="ascii") as f:
            cols = f.readline().split()
        if cols[0] != "cpu" or len(cols) < 9:
            return None
        return int(cols[8]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_cgroup(proc: Path = PROC, root: Path = CGROUP) -> Optional[tuple[Path, int]]:
    """(directory, cgroup version) of this process's CPU controller, or None. v2: the unified
    hierarchy's path from ``/proc/self/cgroup``'s ``0::`` line; v1: the ``cpu`` controller's mount
    (``cpu`` or ``cpu,cpuacct``) joined with its path. In a container the paths are usually ``/``;
    a path that is not there falls back to the mount's root, which is then the container's."""
    try:
        lines = (proc / "self" / "cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        names = controllers.split(",")
        if controllers == "" and (root / "cgroup.controllers").exists():
            candidates, version = [root], 2
        elif "cpu" in names:
            candidates, version = [root / controllers, root / "cpu", root / "cpu,cpuacct"], 1
        else:
            continue
        for base in candidates:
            for where in (base / path.lstrip("/"), base):
                if (where / "cpu.stat").exists():
                    return where, version
    return None


def _cgroup_stat(found: Optional[tuple[Path, int]]) -> tuple[Optional[int], Optional[int]]:
    if found is None:
        return None, None
    where, version = found
    try:
        stat = dict(line.split() for line in (where / "cpu.stat").read_text(encoding="ascii").splitlines()
                    if len(line.split()) == 2)
        if version == 2:
            return int(stat["throttled_usec"]) * 1000, int(stat["nr_throttled"])
        return int(stat["throttled_time"]), int(stat["nr_throttled"])
    except (OSError, ValueError, KeyError):
        return None, None


def cpu_quota(found: Optional[tuple[Path, int]]) -> Optional[float]:
    """Cores the cgroup may use per period (quota / period), None without a quota or a cgroup."""
    if found is None:
        return None
    where, version = found
    try:
        if version == 2:
            quota, period = (where / "cpu.max").read_text(encoding="ascii").split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((where / "cpu.cfs_quota_us").read_text(encoding="ascii"))
        period = int((where / "cpu.cfs_period_us").read_text(encoding="ascii"))
        return None if quota < 0 else quota / period
    except (OSError, ValueError):
        return None


class MachineClock:
    """Reads :class:`MachineTimes` for this process (the cgroup is found once)."""

    def __init__(self, proc: Path = PROC, root: Path = CGROUP) -> None:
        self._proc = proc
        self._cgroup = cpu_cgroup(proc, root)
        self.quota_cores = cpu_quota(self._cgroup)

    def read(self) -> MachineTimes:
        throttled, throttles = _cgroup_stat(self._cgroup)
        return MachineTimes(_steal_ns(self._proc), throttled, throttles)


def native_threads_ns(prefix: str) -> Optional[int]:
    """ns on a core so far of this process's native threads whose kernel name starts with ``prefix``
    (``pt_autograd``: autograd's device threads, which queue a CUDA backward while the launching
    thread waits for them); None where ``/proc`` is not there."""
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            if _native_name(task, int(task.name)).startswith(prefix):
                total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue   # a thread that ended meanwhile
    return total


class HostWindow:
    """The host's figures per window (a training step, a timed pass), read on the launching thread:
    ``read()`` gives what accrued since the previous ``read()`` in ms, keys left out where Linux does
    not say (:data:`HOST_KEYS`): the launching thread on a core, of it in the kernel, waiting for a
    core, its page faults and the times it blocked (voluntary context switches: a handful per step
    for the loader and autograd's threads, one more per wait for Python's lock, which is handed over
    every 5 ms); autograd's device threads on a core; the hypervisor's steal and the cgroup's
    throttling. A read from another thread than the one that made the window gives the
    machine's figures only."""

    def __init__(self, clock: Optional[MachineClock] = None) -> None:
        self._clock = clock or MachineClock()
        self._thread = threading.get_native_id()
        self._last = self._reading()

    def _reading(self) -> tuple[MachineTimes, Optional[ThreadTimes], Optional[int]]:
        mine = thread_times() if threading.get_native_id() == self._thread else None
        return self._clock.read(), mine, native_threads_ns("pt_autograd")

    def read(self) -> dict[str, float]:
        now = self._reading()
        (machine, mine, autograd), (machine0, mine0, autograd0) = now, self._last
        self._last = now
        d = machine.since(machine0)
        ns = {"steal_ms": d.steal_ns, "throttled_ms": d.throttled_ns}
        counts = {}
        if mine is not None and mine0 is not None:
            t = mine.since(mine0)
            ns.update(host_cpu_ms=t.cpu_ns, host_kernel_ms=t.system_ns, host_runqueue_ms=t.wait_ns)
            counts = {"host_faults": t.faults, "host_switches": t.voluntary}
        if autograd is not None and autograd0 is not None:
            ns["autograd_cpu_ms"] = autograd - autograd0
        out = {k: v / 1e6 for k, v in ns.items() if v is not None}
        out.update({k: float(v) for k, v in counts.items() if v is not None})
        return out


class HostClockObserver:
    """A west-train step observer (west.train.loop.StepObserver): each step's record gets the host's
    figures since the previous step's (:class:`HostWindow`, made on the training thread)."""

    def __init__(self) -> None:
        self._window: Optional[HostWindow] = None

    def around_step(self, model, optimizer):
        if self._window is None:
            self._window = HostWindow()
        return contextlib.nullcontext()

    def step_record(self) -> dict:
        return self._window.read() if self._window is not None else {}


HOST_KEYS = ("host_cpu_ms", "host_kernel_ms", "host_runqueue_ms", "host_faults", "host_switches",
             "autograd_cpu_ms", "steal_ms", "throttled_ms")


def host_line(f: dict[str, float]) -> str:
    """:class:`HostWindow`'s figures (or their means per step) as a phrase; "" where none is known."""
    parts = []
    if "host_cpu_ms" in f:
        inner = [f"{f['host_kernel_ms']:.1f} in the kernel" if "host_kernel_ms" in f else "",
                 f"{f['host_faults']:.0f} page faults" if "host_faults" in f else "",
                 f"{f['host_switches']:.0f} times blocked" if "host_switches" in f else ""]
        inner_text = ", ".join(x for x in inner if x)
        waiting = f", {f['host_runqueue_ms']:.1f} waiting for one" if "host_runqueue_ms" in f else ""
        parts.append(f"the launching thread {f['host_cpu_ms']:.1f} on a core"
                     f"{f' ({inner_text})' if inner_text else ''}{waiting}")
    if "autograd_cpu_ms" in f:
        parts.append(f"autograd's threads {f['autograd_cpu_ms']:.1f} on a core")
    taken = [f"{what} {f[key]:.1f}" for key, what in (("steal_ms", "the hypervisor's steal (all CPUs)"),
                                                      ("throttled_ms", "the cgroup's throttling")) if key in f]
    if taken:
        parts.append("taken by the machine: " + ", ".join(taken))
    return "; ".join(parts)


def describe(quota: Optional[float], d: MachineTimes, seconds: Optional[float] = None) -> str:
    """One line: the quota and what was taken, in CPU-seconds (both counters add up over CPUs);
    steal also as a share of all CPUs' time over ``seconds`` of wall time."""
    cpus = os.cpu_count() or 1
    steal = "not known" if d.steal_ns is None else f"{d.steal_ns / 1e9:.2f} CPU-s"
    if d.steal_ns is not None and seconds:
        steal += f" ({100 * d.steal_ns / 1e9 / (seconds * cpus):.1f} % of the CPUs' time)"
    throttled = "not known" if d.throttled_ns is None else f"{d.throttled_ns / 1e9:.2f} CPU-s"
    if d.throttles is not None:
        throttled += f" in {d.throttles} periods"
    limit = "no CPU quota" if quota is None else f"a CPU quota of {quota:g} cores"
    return f"{limit}, {cpus} CPUs; steal {steal}; cgroup throttled {throttled}"


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m west.lab.host_clock FILE``: write a reading to FILE; ``--since FILE``: print one
    line of what accrued since that reading (tools/gpu_suite.sh, around each part)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?", help="write the reading here (JSON)")
    ap.add_argument("--since", help="a reading written before: print what accrued since")
    args = ap.parse_args(argv)
    clock = MachineClock()
    now = clock.read()
    if args.file:
        Path(args.file).write_text(json.dumps({**now.__dict__, "wall": time.time()}), encoding="utf-8")
    if args.since:
        start = json.loads(Path(args.since).read_text(encoding="utf-8"))
        seconds = time.time() - start.pop("wall")
        print(describe(clock.quota_cores, now.since(MachineTimes(**start)), seconds))
    elif not args.file:
        print(describe(clock.quota_cores, now) + " (since boot)")


if __name__ == "__main__":
    main(sys.argv[1:])
