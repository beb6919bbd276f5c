#!/usr/bin/env python3
"""Where the launching thread spends a training step, from py-spy's native samples (west.lab.stack_samples).

    py-spy record --native --idle --rate 200 --format raw -o stacks.txt -- \\
        python tools/profile_step.py ... --modes pack --phase_marks --steps 20 --single_thread_backward
    python tools/stack_summary.py stacks.txt --rate 200 --steps 22 --out stacks.json

``--steps``: the steps the samples cover (profile_step's warm-up steps count: they run train_step
too). ``--focus FUNCTION`` (repeatable): that function's time by callee and by leaf frame. Prints markdown
tables (own time by library and by frame, named parts with their callees, west's and transformers'
functions; then every thread's busy time over the whole recording, waits for work left out, and where
it is busy: which other thread works beside the step), writes them as JSON. Not a test.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from west.lab.stack_samples import parse_raw, summarize, table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", type=Path, help="py-spy record --format raw output")
    p.add_argument("--rate", type=float, required=True, help="the sampling rate given to py-spy (Hz)")
    p.add_argument("--steps", type=int, required=True, help="train_step calls the samples cover")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--focus", action="append", default=[], metavar="FUNCTION",
                   help="a Python function as py-spy names it (Projector.forward): its time by callee and by leaf")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the tables")
    a = p.parse_args(argv)
    res = summarize(parse_raw(a.raw.read_text(encoding="utf-8", errors="replace")), a.rate, a.steps, a.top,
                    tuple(a.focus))
    if not res["samples"]:
        print(f"[stack_summary] {a.raw}: no sample inside train_step or queue_train_step")
        return 1
    print(table(res))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
