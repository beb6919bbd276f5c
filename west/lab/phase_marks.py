"""Phase marks: where the host and the GPU are at each boundary of a training step, unprofiled.

A profiler slows the host it measures (2.4x per step at the seed's shapes on an H200), so a
profiled trace cannot say which phases the host paces once the profiler is off. A mark costs a
clock read and, on CUDA, one event queued on the current stream, at the boundaries
:func:`west.train.phases.phase_hooks` finds. After the step each mark says when the host reached it
and when the GPU did; the difference, the *lag*, is how much work the host had queued ahead. A
phase that starts and ends with near-zero lag is paced by the host. On a CPU every lag is zero and
the table gives the host's time per phase. :class:`StepClock` is a west-train observer
(``python -m west.lab.train --phase_marks``) and ``tools/profile_step.py --phase_marks`` uses it;
west.lab.phase_table turns the marks into tables.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch

from west.lab.phase_table import phases
from west.train.phases import phase_hooks


class StepClock:
    """Marks at phase boundaries: the host's clock, and on CUDA an event on the current stream."""

    def __init__(self, cuda: Optional[bool] = None) -> None:
        self.cuda = cuda   # None: decided at the first step, from where the model's parameters are
        self.marks: list[tuple[str, float, Optional[torch.cuda.Event]]] = []
        self.last: list[dict] = []   # the phases of the step :meth:`around_step` marked last

    def mark(self, name: str) -> None:
        """A mark now. None while a CUDA graph is being captured (``train.encoder_graphs``' first step): a
        timing event has no place in a graph, and that step is not a steady one anyway."""
        event = None
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((name, time.perf_counter(), event))

    @contextlib.contextmanager
    def hooks(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        with phase_hooks(model, optimizer, self.mark, lambda part: self.mark("after " + part), self.mark):
            yield

    @contextlib.contextmanager
    def around_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Mark the step run in the block (hooks only meanwhile) and keep its phases in :attr:`last`.
        On CUDA this waits for the step's last kernels (the optimizer's, after the step's read-back)."""
        self.marks = []
        if self.cuda is None:
            self.cuda = next(model.parameters()).device.type == "cuda"
        with self.hooks(model, optimizer):
            self.mark("step")
            yield
            self.mark("end")
        self.last = phases(self.read())

    def read(self) -> list[tuple[str, float, float]]:
        """(name, host ms, GPU ms) of every mark since the first, in the host's order; clears the marks.
        Waits for the last event. On a CPU the GPU column repeats the host's."""
        marks, self.marks = sorted(self.marks, key=lambda m: m[1]), []
        if not marks:
            return []
        if self.cuda:
            marks[-1][2].synchronize()
        h0, e0 = marks[0][1], marks[0][2]
        out = []
        for name, host, event in marks:
            ms = 1e3 * (host - h0)
            out.append((name, ms, e0.elapsed_time(event) if self.cuda else ms))
        return out

    def step_record(self) -> dict:
        """What the observed step adds to its train_log.jsonl record."""
        return {"phase_marks": {"gpu": self.cuda, "phases": self.last}}
