"""Where a thread's wall time goes: on a core, waiting for one, or blocked; and what the process's
other threads ran meanwhile.

A phase that takes the host 30 ms for a handful of operators (west-train's projector on an H200,
seventh GPU run) is either working (slow code, slow launches), runnable but without a core
(contention: the loader's processes, torch's CPU threads), or blocked (a lock: Python's or the
driver's; a wait for the GPU in blocking mode; I/O). Linux keeps the three apart per thread:
``/proc/thread-self/schedstat`` holds the time spent waiting on a run queue, the thread's resource
usage its voluntary (blocked) and involuntary (preempted) context switches, and its CPU clock the
time on a core; the rest of the wall time the thread was blocked. Other threads' time on a core
in the same window says who ran meanwhile (a Python thread there may hold the interpreter's lock).
On a virtual machine the time the hypervisor takes the thread's vCPU is in neither clock, so it
counts as blocked too; :mod:`west.machine_clock` reads that steal (and a cgroup's throttling)
beside it.

Elsewhere only the thread's CPU time is known; the other figures are None.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from west.machine_clock import Counters

try:
    import resource
    _RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)   # Linux
except ImportError:   # Windows
    _RUSAGE_THREAD = None

_SELF = Path("/proc/thread-self")
_TASKS = Path("/proc/self/task")


@dataclass(frozen=True)
class ThreadTimes(Counters):
    """One reading of the calling thread's clocks (ns) and context switches."""

    cpu_ns: int                     # on a core (CLOCK_THREAD_CPUTIME_ID: exact for the running thread)
    wait_ns: Optional[int]          # runnable, waiting on a run queue (schedstat's run_delay)
    voluntary: Optional[int]        # switches away because it blocked
    involuntary: Optional[int]      # switches away because it was preempted
    system_ns: Optional[int] = None   # of cpu_ns, in the kernel (system calls: the driver's ioctls, page faults)
    faults: Optional[int] = None      # page faults, minor and major (first touches of new memory, pinning)

    @staticmethod
    def zero() -> "ThreadTimes":
        return ThreadTimes(0, 0, 0, 0, 0, 0)


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
    (native)``; torch's OpenMP workers inherit the process's, ``python (native)``). Empty where ``/proc`` is not there. A running thread's figure lags by up
    to a scheduler tick, which averages out over steps."""
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
