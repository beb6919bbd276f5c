"""Time the machine took from the process: the hypervisor's steal and the cgroup's CPU throttling.

A launching thread that is neither on a core nor waiting on a run queue counts as blocked
(:mod:`west.bench.thread_clock`), and a blocked thread reads as a lock or a wait. Two things
outside the process look the same from inside it:

* **steal**: on a virtual machine the hypervisor runs something else on the vCPU. The guest kernel
  keeps the time out of the thread's clocks (paravirtual time accounting) and adds it up per CPU
  as ``steal`` in ``/proc/stat``;
* **throttling**: a container's cgroup with a CPU quota stops all its threads once the quota of a
  period (100 ms by default) is spent, until the next period; a process with many busy threads
  (torch's intra-op pool, loader workers) can spend 16 cores' quota in a few ms. The cgroup's
  ``cpu.stat`` counts the periods throttled and their time (v2 ``throttled_usec``, v1
  ``throttled_time``).

Both are read in a few tens of microseconds and only where Linux provides them; elsewhere None.
Standard library only: the training loop, the benchmark and ``tools/gpu_suite.sh`` (``python -m
west.machine_clock``) read the same figures.
"""
from __future__ import annotations

import argparse
import json
import operator
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")


class Counters:
    """Base of frozen dataclasses of counters, each an int or None where it is not known: a
    difference of two readings and a sum over steps keep None wherever either side has it."""

    def since(self, start):
        """What accrued from ``start`` to this reading."""
        return self._combine(start, operator.sub)

    def plus(self, other):
        """Both added up (per-phase figures over steps)."""
        return self._combine(other, operator.add)

    def _combine(self, other, op):
        pairs = ((getattr(self, f.name), getattr(other, f.name)) for f in fields(self))
        return type(self)(*(None if a is None or b is None else op(a, b) for a, b in pairs))


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
            fields = f.readline().split()
        if fields[0] != "cpu" or len(fields) < 9:
            return None
        return int(fields[8]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
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


class MachineWindow:
    """Steal and throttling per window, for the training loop's per-step records: ``read()`` gives
    what accrued since the previous ``read()`` in ms (keys left out where Linux does not say)."""

    def __init__(self, clock: Optional[MachineClock] = None) -> None:
        self._clock = clock or MachineClock()
        self._last = self._clock.read()

    def read(self) -> dict[str, float]:
        now = self._clock.read()
        d, self._last = now.since(self._last), now
        out = {}
        if d.steal_ns is not None:
            out["steal_ms"] = d.steal_ns / 1e6
        if d.throttled_ns is not None:
            out["throttled_ms"] = d.throttled_ns / 1e6
        return out


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
    """``python -m west.machine_clock FILE``: write a reading to FILE; ``--since FILE``: print one
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
