#!/usr/bin/env python3
"""Host synchronisations per training step on CUDA, by source line.

torch's sync debug mode warns at every operation that makes the host wait for the GPU (a value
read back, a pageable copy, a boolean-mask index, ``nonzero``). This runs the production step
(``west.train.step.train_step``) over each mode's batches of the same N utterances with that mode
on, after one warm-up step, and counts the warnings per step by the line of west (or the first
line outside torch) that caused them. A step is meant to have one: the read of its figures at
its end. On a CPU there is nothing to count; ``tests/test_models_sync_free.py`` proves the same
on the ``meta`` device instead. Not a test: a table and a JSON.

    python tools/count_syncs.py --config recipes/aishell/conf/seed_gpu.yaml --model.llm.path exp/seed_llm \\
        --data data/train/data.list --data.cmvn data/train/global_cmvn.json --num_utts 200 --out syncs.json
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path
from typing import Callable

from west.lab.sync_count import count_syncs
from west.lab.tool_setup import add_setup_args


def per_mode(setup, steps: int, debug_mode: Callable[[int], None]) -> dict:
    """{mode name: syncs per counted step and where} over each mode's first ``steps`` + 1 batches
    (``setup``: a west.lab.tool_setup.ToolSetup)."""
    from west.bench.modes import model_overrides

    rows = {}
    runner = setup.runner
    for m in setup.modes:
        batches = setup.batches(m, steps + 1)
        with model_overrides(runner.model, m.model):
            opt, sched = runner.fresh(len(batches))
            runner.step(batches[0], opt, sched)                          # warm-up: first-call syncs
            per_step, places = [], collections.Counter()
            for b in batches[1:]:
                found = count_syncs(lambda: runner.step(b, opt, sched), debug_mode)
                per_step.append(sum(found.values()))
                places.update(found)
        rows[m.name] = {"steps": len(per_step), "per_step": per_step,
                        "median": statistics.median(per_step) if per_step else None, "where": dict(places)}
        print(f"[count_syncs] {m.name}: {rows[m.name]['median']} per step over {len(per_step)} steps", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Any config key can be overridden as --section.key VALUE, as in west-train.")
    add_setup_args(p)
    p.add_argument("--steps", type=int, default=5, help="counted steps per mode, after one warm-up")
    p.add_argument("--out", default=None, help="JSON file for the full counts")
    args, rest = p.parse_known_args(argv)

    import tempfile

    import torch

    from west.config import load_config, split_overrides
    from west.lab.tool_setup import tool_setup
    from west.ranks import cuda_allocator_defaults, resolved_device

    cuda_allocator_defaults()
    if torch.device(resolved_device(load_config(args.config, split_overrides(rest)).train.device)).type != "cuda":
        print("count_syncs: needs CUDA (torch.cuda.set_sync_debug_mode); on a CPU, "
              "tests/test_models_sync_free.py checks the step on the meta device")
        return 2
    setup = tool_setup(args, rest, Path(tempfile.mkdtemp()) / "syncs_data.list")
    rows = per_mode(setup, args.steps, torch.cuda.set_sync_debug_mode)
    lines = ["| mode | steps | syncs per step (median) | where (count over all steps) |", "|---|---|---|---|"]
    for name, r in rows.items():
        top = "; ".join(f"{k} ×{v}" for k, v in sorted(r["where"].items(), key=lambda kv: -kv[1])[:4])
        lines.append(f"| {name} | {r['steps']} | {r['median']} | {top or '-'} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(setup.device),
                                              "torch": torch.__version__, "modes": rows}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
