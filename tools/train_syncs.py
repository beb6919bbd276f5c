#!/usr/bin/env python3
"""Host synchronisations of a whole west-train run on CUDA, by source line.

``tools/count_syncs.py`` counts them in the benchmark's runner, which has no loader: one per step,
the read of its figures (H200). West-train's host waits for the GPU in its projector, loss and
splice backward phases too (docs/notebook.md, run 8), where the benchmark's does not.
This runs west-train itself, loader, pin-memory thread and loop included, under the same counter
(torch's sync debug mode; each warning placed at the innermost line of this repository, from any
thread), and prints the places with their counts over the run and per step (``--steps``: the
run's steps; the start's capture and warm-up are counted too, once). Not a test.

    python tools/train_syncs.py --steps 20 --out syncs_train.json --md syncs_train.md -- \\
        --config recipes/aishell/conf/seed_gpu.yaml --max_steps 20 ...
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Callable, Sequence

from west.lab.sync_count import count_syncs


def counted_run(train_main: Callable[[Sequence[str]], int], train_argv: Sequence[str],
                debug_mode: Callable[[int], None]) -> tuple[int, collections.Counter]:
    """(west-train's exit code, its sync warnings by place) with ``debug_mode(1)`` for the run."""
    rc = []
    found = count_syncs(lambda: rc.append(train_main(list(train_argv))), debug_mode)
    return rc[0], found


def table(found: collections.Counter, steps: int, top: int = 12) -> str:
    """Markdown: the ``top`` places by count, with counts per step."""
    lines = [f"host synchronisations in west-train: {sum(found.values()):,} over {steps} steps "
             f"({sum(found.values()) / max(steps, 1):.1f} per step, the start's included)", "",
             "| where | syncs | per step |", "|---|---|---|"]
    lines += [f"| `{place}` | {n:,} | {n / max(steps, 1):.1f} |" for place, n in found.most_common(top)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- (or any this tool does not take) go to west-train.")
    p.add_argument("--steps", type=int, required=True, help="the run's steps (its --max_steps), for the per-step column")
    p.add_argument("--out", type=Path, default=None, help="JSON of every place and count")
    p.add_argument("--md", type=Path, default=None, help="the table as markdown")
    p.add_argument("--top", type=int, default=12)
    args, rest = p.parse_known_args(argv)
    rest = [a for a in rest if a != "--"]

    import torch

    from west.ranks import cuda_allocator_defaults

    cuda_allocator_defaults()   # as west-train sets it, before the debug mode's switch initialises CUDA
    if not torch.cuda.is_available():
        print("train_syncs: needs CUDA (torch.cuda.set_sync_debug_mode)")
        return 2
    from west.bin.train import main as train_main

    rc, found = counted_run(train_main, rest, torch.cuda.set_sync_debug_mode)
    text = table(found, args.steps, args.top)
    print(text)
    if args.md:
        args.md.write_text(text + "\n", encoding="utf-8")
    if args.out:
        args.out.write_text(json.dumps({"steps": args.steps, "train_rc": rc, "where": dict(found)}, indent=1),
                            encoding="utf-8")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
