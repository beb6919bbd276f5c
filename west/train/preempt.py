"""Preemption: stop at a step boundary with a checkpoint when the job is told it will be killed.

A cluster job gets SIGTERM (SLURM, Kubernetes, torchrun forwarding its own) or SIGUSR1
(SLURM's ``--signal``) some seconds before SIGKILL. The handler only notes the signal; the
loop carries "I was signalled" in the step's host all-reduce that already exists
(``west.train.step.plan_step``), so every rank learns it at the same step even when only one
was signalled. That step runs to its end, every rank writes the checkpoint at it (the usual
collective, atomic save), and west-train exits with :data:`PREEMPTED_EXIT_CODE`. The same
command then resumes from that checkpoint as from any other.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
import threading
from functools import partial
from types import FrameType
from typing import Any, Callable, Optional, Sequence

# EX_TEMPFAIL (sysexits.h): "a temporary failure; try again later". Not 143 (128 + SIGTERM):
# a shell reports 143 for a process that SIGTERM killed before it could save anything.
PREEMPTED_EXIT_CODE = 75

UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def is_catchable(name: str) -> bool:
    """``name`` is a signal this platform has (``SIGTERM``, ``SIGUSR1``...) and a handler can catch."""
    return isinstance(name, str) and name in signal.Signals.__members__ and name not in UNCATCHABLE


class Preemption:
    """Handlers for ``signals`` while inside ``with``; the previous ones come back on exit.

    ``requested`` is the name of the first of them received (None: none yet). Further
    signals are ignored: torchrun forwards the SIGTERM that a scheduler also sends to every
    process, so a second one is normal and must not kill the save in progress (SIGKILL or
    Ctrl-C still stop at once)."""

    def __init__(self, signals: Sequence[str]) -> None:
        self.signals = [signal.Signals[name] for name in signals]
        self.requested: Optional[str] = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        # A Python handler runs in the main thread between bytecodes: only note it (printing
        # here could re-enter a print in progress).
        if self.requested is None:
            self.requested = signal.Signals(signum).name

    def __enter__(self) -> "Preemption":
        if self.signals and threading.current_thread() is not threading.main_thread():
            print(f"WARNING: train.preempt_signals {[s.name for s in self.signals]} not handled: "
                  "signal handlers can only be set from the main thread", file=sys.stderr, flush=True)
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            # None: the previous handler was not set from Python; the default is what it was
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


def agreed_signal(requested: Optional[str]) -> str:
    """Collective, once all ranks agreed to stop: the name of the signal, whichever rank got it
    (the highest-numbered one if ranks got different signals), so every rank's messages and the
    checkpoint's meta.json name it."""
    from west.ranks import all_reduce_max  # torch.distributed: only when stopping

    number = int(all_reduce_max([int(signal.Signals[requested]) if requested else 0])[0])
    return signal.Signals(number).name if number else "a signal"


def shield_loader_workers(loader: Any, signals: Sequence[str]) -> None:
    """Make ``loader``'s worker processes ignore ``signals`` until the main process exits.

    A scheduler signals every process of the job, DataLoader workers included, and torch's
    workers die on SIGTERM (their C handler re-raises it): the main process then failed with
    "DataLoader worker ... is killed by signal" instead of saving. A worker still ends when its
    loader shuts down or the main process dies (torch's own watchdog). But when the main process
    exits with its loader still open (an uncaught exception, Ctrl-C), Python's exit handler
    SIGTERMs the workers and waits for them: a worker that ignored that signal kept the run
    alive forever. So the shield holds only until the main process starts to exit (an event set
    by its first exit handler); after that the signal ends the worker at once."""
    if not signals:
        return
    ctx = loader.multiprocessing_context or multiprocessing.get_context()
    exiting = ctx.Event()   # in the loader's context: a spawned worker can only inherit its own
    atexit.register(exiting.set)  # registered after multiprocessing's own handler: runs before it
    loader.worker_init_fn = partial(_shield, tuple(signals), exiting, loader.worker_init_fn)


def _shield(signals: tuple[str, ...], exiting: Any, then: Optional[Callable[[int], None]], worker_id: int) -> None:
    def handle(signum: int, frame: Optional[FrameType]) -> None:
        if exiting.is_set():
            os._exit(0)  # the main process is exiting and asks its workers to end: a clean end

    for name in signals:
        signal.signal(signal.Signals[name], handle)
    if then is not None:
        then(worker_id)
