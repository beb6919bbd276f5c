#!/usr/bin/env python3
"""The host's time in west-train's projector, splice and loss phases, operator by operator.

West-train's projector and splice phases took the host 30 and 16 ms per step on an H200 with the
GPU idle, against about 1 ms each in the benchmark's runner (docs/notebook.md, run 8).
This runs west-train itself (loader, pin-memory thread and loop included) with
:class:`west.lab.op_times.PhaseOpTimes` around every step: in the watched phases each dispatched
operator's host time and the Python between operators, by line. An operator that blocks (a
page-locked allocation, a wait for the GPU, a lazily loaded kernel) shows as one long call; slow
Python shows between operators. With ``--preload N`` west-train trains on its loader's first N
batches from memory, the loader ended (west.lab.preloaded): the same loop without the loader
beside it. Not a test; the timer costs microseconds per operator.

    python tools/train_op_times.py --skip 5 --out op_times_train.json --md op_times_train.md -- \\
        --config recipes/aishell/conf/seed_gpu.yaml --max_steps 20 ...
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

from west.lab.op_times import WATCHED, PhaseOpTimes, table
from west.lab.preloaded import PreloadedData

STEP_FUNCTIONS = ("train_step", "queue_train_step")   # what west.train.loop calls once per step


def timed_run(train_main: Callable[[Sequence[str]], int], train_argv: Sequence[str], timer: PhaseOpTimes,
              loop_module) -> int:
    """West-train's exit code, each of its steps run inside ``timer.hooks`` (the loop's step
    functions wrapped for the run, then put back)."""
    originals = {name: getattr(loop_module, name) for name in STEP_FUNCTIONS}

    def timed(step: Callable) -> Callable:
        def run(model, micro_batches, plan, optimizer, *args, **kwargs):
            with timer.hooks(getattr(model, "module", model), optimizer):
                return step(model, micro_batches, plan, optimizer, *args, **kwargs)
        return run

    for name, step in originals.items():
        setattr(loop_module, name, timed(step))
    try:
        return train_main(list(train_argv))
    finally:
        for name, step in originals.items():
            setattr(loop_module, name, step)


@contextlib.contextmanager
def preloading(loop_module, n: int, made: list) -> Iterator[None]:
    """West-train's Trainer gets its loader's first ``n`` batches from memory (west.lab.preloaded):
    its loop without the loader beside it. ``made`` collects the PreloadedData built."""
    original = loop_module.Trainer.__init__

    def init(self, train, run, model, data, *args, **kwargs):
        made.append(PreloadedData(data, n))
        original(self, train, run, model, made[-1], *args, **kwargs)

    loop_module.Trainer.__init__ = init
    try:
        yield
    finally:
        loop_module.Trainer.__init__ = original


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- (or any this tool does not take) go to west-train.")
    p.add_argument("--phases", default=",".join(WATCHED), help="phases to time (names of the phase marks)")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the summary (warm-up, first shapes)")
    p.add_argument("--top", type=int, default=8, help="entries per phase")
    p.add_argument("--out", type=Path, default=None, help="JSON of the summary")
    p.add_argument("--md", type=Path, default=None, help="the tables as markdown")
    p.add_argument("--switch_interval_ms", type=float, default=None,
                   help="how often Python's lock changes hands when threads want it (sys.setswitchinterval; "
                        "5 ms by default): smaller shortens each wait for it, if another thread holds it")
    p.add_argument("--preload", type=int, default=0,
                   help="take this many batches from west-train's loader once, end the loader, and train on them "
                        "from memory (west.lab.preloaded: the loop without the loader beside it); 0 = the loader")
    args, rest = p.parse_known_args(argv)
    rest = [a for a in rest if a != "--"]
    if args.switch_interval_ms is not None:
        if args.switch_interval_ms <= 0:
            p.error(f"--switch_interval_ms must be > 0, got {args.switch_interval_ms}")
        sys.setswitchinterval(args.switch_interval_ms / 1e3)

    import west.train.loop as loop
    from west.bin.train import main as train_main

    if args.preload < 0:
        p.error(f"--preload must be >= 0, got {args.preload}")
    timer = PhaseOpTimes(tuple(args.phases.split(",")))
    made: list[PreloadedData] = []
    with preloading(loop, args.preload, made) if args.preload else contextlib.nullcontext():
        rc = timed_run(train_main, rest, timer, loop)
    skip = min(args.skip, max(len(timer.steps) - 1, 0))
    res = {"train_rc": rc, **timer.summary(skip, args.top)} if timer.steps else {"train_rc": rc, "steps": 0}
    res["switch_interval_ms"] = 1e3 * sys.getswitchinterval()
    text = table(res) if timer.steps else "train_op_times: west-train ran no step"
    if args.switch_interval_ms is not None:
        text += f"\n\n(Python's switch interval: {res['switch_interval_ms']:g} ms)"
    if made:
        res["preload"] = made[0].note
        text += f"\n\n(the loop without its loader: {made[0].note})"
    print(text)
    if args.md:
        args.md.write_text(text + "\n", encoding="utf-8")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1), encoding="utf-8")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
