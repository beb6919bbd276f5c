"""The host's time inside chosen phases of a step, operator by operator, and the Python between them.

On an H200, west-train's projector and splice phases took the host 30 and 16 ms per step with the
GPU idle, for a handful of operators that take the benchmark's runner about 1 ms each (seventh GPU
run, docs/benchmarks.md); in one earlier run the benchmark's own runner took 16.5 and 12 ms there
in one mode and 1.2 and 0.9 in another, for the same shapes. Phase marks say which phase; a
sampling profiler says which library. This says which line: a ``TorchDispatchMode`` is pushed only
while a watched phase runs (:func:`west.train.phases.phase_hooks` finds the boundaries, so
the step runs unchanged elsewhere) and times, on the host's clock,

* each dispatched operator (its call into the backend: a launch, an allocation, a wait), by
  operator and by the innermost line of west that called it;
* the time between operators (Python: index arithmetic, list building, hooks, the timer's own
  entry), by the line of the operator that ended the interval, and after a phase's last operator
  until the phase ends.

and, per phase, where the launching thread's wall time went (on a core, waiting for one, blocked:
:mod:`west.lab.host_clock`) and which other threads of the process ran meanwhile.

Not a benchmark: the mode costs some microseconds per operator, so it is kept to the few phases
asked for. ``tools/train_op_times.py`` runs west-train under it; ``tools/profile_step.py
--op_times`` the benchmark's runner.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from west.lab.host_clock import (
    MachineClock,
    MachineTimes,
    ThreadTimes,
    host_line,
    other_threads,
    others_since,
    thread_times,
)
from west.lab.phase_table import PHASE_NAMES
from west.train.phases import phase_hooks

WATCHED = ("encoder rows", "projector", "splice", "loss")   # phases of a few operators each
ROOT = Path(__file__).resolve().parents[2]                  # the checkout holding west/
_WEST = str(ROOT / "west") + "/"
AFTER_LAST = "(after the phase's last operator)"


def west_place(depth: int = 2) -> str:
    """Where in west an operator was called: the innermost frame in west's package outside this
    module and the west frame that called it (``west/batch.py:128 (to_device) < west/models/
    projector.py:45 (group_frames)``: a helper and its caller); else the innermost frame at all."""
    f = sys._getframe(depth)
    first, found = f, []
    while f is not None and len(found) < 2:
        name = f.f_code.co_filename
        if name.startswith(_WEST) and name != __file__:
            found.append(f"{name[len(str(ROOT)) + 1:]}:{f.f_lineno} ({f.f_code.co_name})")
        f = f.f_back
    if found:
        return " < ".join(found)
    return f"{first.f_code.co_filename}:{first.f_lineno}" if first is not None else "?"


class _Timer(TorchDispatchMode):
    def __init__(self, owner: "PhaseOpTimes") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        t1 = time.perf_counter()
        self.owner._record(str(func.overloadpacket), west_place(), t0, t1)
        return out


class PhaseOpTimes:
    """Host seconds per step inside the ``watched`` phases (names of :data:`PHASE_NAMES`), in
    operators and between them. Use :meth:`hooks` around each step, then :meth:`summary`."""

    def __init__(self, watched: tuple[str, ...] = WATCHED, threads: bool = True) -> None:
        unknown = set(watched) - set(PHASE_NAMES.values())
        if unknown:
            raise ValueError(f"unknown phases {sorted(unknown)}; phases: {sorted(set(PHASE_NAMES.values()))}")
        self.watched = watched
        self.threads = threads            # also read the other threads' clocks at each watched phase's ends
        self.steps: list[dict] = []       # per step: {(phase, kind, name, place): [seconds, calls, max]}
        self._step: dict = {}
        self._totals: list[dict] = []     # per step: {phase: seconds}
        self._total: dict = {}
        self._mode: Optional[_Timer] = None
        self._phase: Optional[str] = None
        self._start = 0.0                 # the open phase's start
        self._since = 0.0                 # the end of the last operator (or the phase's start)
        self._clocks: list[dict] = []     # per step: {phase: [ThreadTimes of the launching thread, {name: ns},
        self._clock: dict = {}            #                    MachineTimes: the hypervisor's steal, throttling]}
        self._opened: Optional[tuple[dict, ThreadTimes, MachineTimes]] = None   # the open phase's first reading
        self._machine = MachineClock()

    # ---------------------------------------------------------------- recording
    def _add(self, key: tuple, seconds: float) -> None:
        row = self._step.setdefault(key, [0.0, 0, 0.0])
        row[0] += seconds
        row[1] += 1
        row[2] = max(row[2], seconds)

    def _record(self, op: str, place: str, t0: float, t1: float) -> None:
        self._add((self._phase, "between", "python", place), t0 - self._since)
        self._add((self._phase, "operator", op, place), t1 - t0)
        self._since = time.perf_counter()
        self._add((self._phase, "timer", "the timer's own bookkeeping", "-"), self._since - t1)

    def _at(self, mark: str) -> None:
        """A phase boundary (a mark of :func:`phase_hooks`): close the phase that ends, open the next."""
        now = time.perf_counter()
        reading = None
        if self._phase is not None:
            self._add((self._phase, "between", "python", AFTER_LAST), now - self._since)
            self._total[self._phase] = self._total.get(self._phase, 0.0) + now - self._start
            reading = self._read_clocks(self._phase)
        phase = PHASE_NAMES.get(mark, mark)
        self._phase = phase if phase in self.watched else None
        if self._phase is not None and self._mode is None:
            self._mode = _Timer(self)
            self._mode.__enter__()
        elif self._phase is None and self._mode is not None:
            self._close()
        if self._phase is not None:   # the clocks' reads fall between phases, outside their times; where
            # one watched phase follows another, the reading that closed the first opens the second
            self._opened = reading or ((other_threads() if self.threads else {}), thread_times(),
                                       self._machine.read())
        self._start = self._since = time.perf_counter()

    def _read_clocks(self, phase: str) -> tuple[dict, ThreadTimes, MachineTimes]:
        """Add the launching thread's clocks, the other threads' time on a core and what the machine
        took since the phase opened; -> the reading taken now (the other threads', the launching
        thread's, the machine's)."""
        mine, machine = thread_times(), self._machine.read()
        others, start, machine_start = self._opened
        now = other_threads() if self.threads else {}
        row = self._clock.setdefault(phase, [ThreadTimes.zero(), {}, MachineTimes.zero()])
        row[0] = row[0].plus(mine.since(start))
        for name, ns in others_since(others, now).items():
            row[1][name] = row[1].get(name, 0) + ns
        row[2] = row[2].plus(machine.since(machine_start))
        return now, mine, machine

    def _close(self) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)

    @contextlib.contextmanager
    def hooks(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Time the watched phases of the step run in the block; the step counts once it ends."""
        self._step, self._total, self._clock, self._phase = {}, {}, {}, None
        try:
            with phase_hooks(model, optimizer, self._at, lambda part: self._at("after " + part)):
                yield
        finally:
            if self._mode is not None:   # a step that raised inside a watched phase
                self._close()
            self._phase = None
        self.steps.append(self._step)
        self._totals.append(self._total)
        self._clocks.append(self._clock)

    # ---------------------------------------------------------------- reading
    def summary(self, skip: int = 0, top: int = 8) -> dict:
        """Per watched phase, over the steps after the first ``skip``: the host's ms per step
        (median); in operators, between them and in the timer's bookkeeping (means, adding up to
        the phase's mean); the ``top`` entries by ms per step, each with its calls per step and its
        longest single call; the launching thread's wall time split (:meth:`_thread_split`) and the
        other threads' time on a core meanwhile, the ``top`` by ms per step."""
        steps, totals = self.steps[skip:], self._totals[skip:]
        if not steps:
            raise ValueError(f"no steps to summarize ({len(self.steps)} timed, {skip} skipped)")
        n = len(steps)
        rows: dict = defaultdict(lambda: [0.0, 0, 0.0])
        for step in steps:
            for key, (s, calls, longest) in step.items():
                row = rows[key]
                row[0] += s
                row[1] += calls
                row[2] = max(row[2], longest)
        out = {"steps": n, "skipped": skip, "phases": []}
        for phase in self.watched:
            mine = {k: v for k, v in rows.items() if k[0] == phase}
            if not mine:
                continue
            by_kind = {kind: 1e3 * sum(v[0] for k, v in mine.items() if k[1] == kind) / n
                       for kind in ("operator", "between", "timer")}
            entries = sorted(((k, v) for k, v in mine.items() if k[1] != "timer"), key=lambda kv: -kv[1][0])[:top]
            out["phases"].append({
                "phase": phase,
                "host_ms": 1e3 * statistics.median(t.get(phase, 0.0) for t in totals),
                "operators_ms": by_kind["operator"], "between_ms": by_kind["between"], "timer_ms": by_kind["timer"],
                "operators_per_step": sum(v[1] for k, v in mine.items() if k[1] == "operator") / n,
                "top": [{"kind": k[1], "name": k[2], "where": k[3], "ms_per_step": 1e3 * v[0] / n,
                         "calls_per_step": v[1] / n, "longest_ms": 1e3 * v[2]} for k, v in entries],
                **self._thread_split(phase, skip, top),
            })
        return out

    def _thread_split(self, phase: str, skip: int, top: int) -> dict:
        """The launching thread's mean ms per step in ``phase``: on a core, runnable without one
        (``runqueue_ms``), blocked (the rest of the phase's mean wall time), with its voluntary and
        involuntary context switches per step; and ``others``: other threads' ms on a core."""
        clocks, walls = self._clocks[skip:], self._totals[skip:]
        n = len(clocks)
        total, taken = ThreadTimes.zero(), MachineTimes.zero()
        others: dict[str, float] = {}
        for clock in clocks:
            mine, theirs, machine = clock.get(phase, (ThreadTimes.zero(), {}, MachineTimes.zero()))
            total, taken = total.plus(mine), taken.plus(machine)
            for name, ns in theirs.items():
                others[name] = others.get(name, 0.0) + ns
        wall = 1e3 * sum(w.get(phase, 0.0) for w in walls) / n
        cpu = total.cpu_ns / 1e6 / n
        wait = None if total.wait_ns is None else total.wait_ns / 1e6 / n
        split = {"wall_ms": wall, "cpu_ms": cpu, "runqueue_ms": wait,
                 "blocked_ms": max(wall - cpu - (wait or 0.0), 0.0),
                 "voluntary_switches": None if total.voluntary is None else total.voluntary / n,
                 "involuntary_switches": None if total.involuntary is None else total.involuntary / n,
                 "system_ms": None if total.system_ns is None else total.system_ns / 1e6 / n,
                 "page_faults": None if total.faults is None else total.faults / n,
                 "steal_ms": None if taken.steal_ns is None else taken.steal_ns / 1e6 / n,
                 "throttled_ms": None if taken.throttled_ns is None else taken.throttled_ns / 1e6 / n}
        ranked = sorted(others.items(), key=lambda kv: -kv[1])[:top]
        return {"thread": split, "others": [{"thread": name, "cpu_ms_per_step": ns / 1e6 / n} for name, ns in ranked]}


def thread_line(p: dict) -> str:
    """One line of a phase's thread split (:meth:`PhaseOpTimes._thread_split`)."""
    t = p.get("thread")
    if t is None:
        return ""
    wait = "?" if t["runqueue_ms"] is None else f"{t['runqueue_ms']:.1f}"
    switches = ("" if t["voluntary_switches"] is None else
                f" ({t['voluntary_switches']:.1f} voluntary and {t['involuntary_switches']:.1f} involuntary "
                f"context switches)")
    kernel = ("" if t.get("system_ms") is None else
              f" ({t['system_ms']:.1f} of them in the kernel, {t['page_faults']:.0f} page faults)")
    line = (f"the launching thread, means per step: {t['cpu_ms']:.1f} ms on a core{kernel}, {wait} ms waiting for one, "
            f"{t['blocked_ms']:.1f} ms blocked{switches}")
    busy = [o for o in p.get("others", []) if o["cpu_ms_per_step"] >= 0.05]
    if busy:
        line += "; other threads on a core meanwhile: " + ", ".join(
            f"`{o['thread']}` {o['cpu_ms_per_step']:.1f} ms" for o in busy)
    taken = host_line({k: t[k] for k in ("steal_ms", "throttled_ms") if t.get(k) is not None})
    if taken:   # time off a core that is neither the run queue's nor the thread's own blocking
        line += f"; {taken} ms"
    return line


def python_lock_suspects(res: dict, blocked_share: float = 0.3, python_share: float = 0.1) -> list[str]:
    """The phases of :meth:`PhaseOpTimes.summary`'s ``res`` in which the launching thread was blocked
    for at least ``blocked_share`` of the phase's mean wall time while one Python thread of the
    process (named by ``threading``, not a native one) was on a core for at least ``python_share``
    of it: the pattern of a wait for Python's lock, each as a line that says so."""
    out = []
    for p in res.get("phases", []):
        t = p.get("thread")
        if not t or t["wall_ms"] <= 0 or t["blocked_ms"] < blocked_share * t["wall_ms"]:
            continue
        python = [o for o in p.get("others", []) if not o["thread"].endswith(" (native)")
                  and o["cpu_ms_per_step"] >= python_share * t["wall_ms"]]
        if python:
            out.append(f"{p['phase']}: {t['blocked_ms']:.1f} of {t['wall_ms']:.1f} ms blocked while "
                       + ", ".join(f"`{o['thread']}` ran {o['cpu_ms_per_step']:.1f} ms" for o in python))
    return out


def table(res: dict) -> str:
    """Markdown of :meth:`PhaseOpTimes.summary`: one line and one table per phase."""
    n = res["steps"]
    lines = [f"host time in operators and between them, {n} step{'s' if n != 1 else ''} "
             f"(the first {res['skipped']} left out), per step", ""]
    for p in res["phases"]:
        lines += [f"**{p['phase']}**: {p['host_ms']:.1f} ms (median); {p['operators_ms']:.1f} ms in "
                  f"{p['operators_per_step']:.0f} operators, {p['between_ms']:.1f} ms between them, "
                  f"{p['timer_ms']:.1f} ms the timer's own (means)", ""]
        if thread_line(p):
            lines += [thread_line(p), ""]
        lines += ["| what | where | ms per step | calls per step | longest call ms |", "|---|---|---|---|---|"]
        for e in p["top"]:
            what = e["name"] if e["kind"] == "operator" else "Python before it"
            if e["where"] == AFTER_LAST:
                what = "Python"
            lines.append(f"| `{what}` | `{e['where']}` | {e['ms_per_step']:.2f} | {e['calls_per_step']:.1f} | "
                         f"{e['longest_ms']:.2f} |")
        lines.append("")
    return "\n".join(lines).rstrip()
