#!/usr/bin/env python3
"""Dispatched aten operators per training step, per batch mode, any device: the launch count that paces a step on a GPU.

The same counts ``west-benchmark`` reports beside its times (west.bench.op_counter), without
the timed passes and the FLOP count: load each mode's batches of the same N utterances, run
one training pass per mode through the production step with every dispatched operator
counted (forward / backward / optimizer / other), then the speech encoder alone on the same
batches. Prints the markdown table and writes OUT_DIR/ops.{json,md}. Counts do not depend on
the machine's speed or load; they do depend on the device (CUDA kernels, foreach optimizers),
the torch version and the code.

    python tools/count_ops.py --config recipes/aishell/conf/seed_depth_tiny.yaml \\
        --model.llm.path exp/seed_depth_llm --data.cmvn data/train/global_cmvn.json \\
        --data data/train/data.list --num_utts 200 --out_dir exp/ops --threads 1
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from west.lab.tool_setup import add_setup_args

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Any config key can be overridden as --section.key VALUE, as in west-train.")
    add_setup_args(p)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    args, rest = p.parse_known_args(argv)

    import torch

    from west.bench.modes import model_overrides
    from west.bench.op_counter import count_encoder_ops, count_step_ops
    from west.bench.report import ops_table
    from west.host_memory import keep_freed_host_memory
    from west.lab.tool_setup import tool_setup

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    setup = tool_setup(args, rest, out / "ops_data.list")
    cfg, device, model, runner = setup.cfg, setup.device, setup.runner.model, setup.runner
    if device.type == "cpu":
        keep_freed_host_memory()
    results = {}
    for m in setup.modes:
        t0 = time.perf_counter()
        batches = setup.batches(m)
        with model_overrides(model, m.model):
            ops = count_step_ops(runner, batches)
            enc = count_encoder_ops(model, batches, device, cfg.train.precision)
        results[m.name] = {"method": m.method, "configuration": m.configuration, "ops": ops, "encoder_ops": enc}
        print(f"[count_ops] {m.name}: {len(batches)} steps, {ops['per_step']['total']:,.0f} ops per step, "
              f"encoder alone {enc['per_step']['total']:,.0f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    res = {"modes": results, "num_utts": args.num_utts, "device": str(device), "torch": torch.__version__,
           "commit": commit, "precision": cfg.train.precision,
           "command": " ".join(["python tools/count_ops.py", *(argv if argv is not None else sys.argv[1:])])}
    table = ops_table(res)
    (out / "ops.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    (out / "ops.md").write_text(f"{table}\n\n{args.num_utts} utterances, {device}, torch {torch.__version__}, "
                                f"code {commit}, precision {cfg.train.precision}\n", encoding="utf-8")
    print(table)
    print(f"[count_ops] {args.num_utts} utterances, {device}, torch {torch.__version__}, code {commit}; "
          f"wrote {out / 'ops.json'}, {out / 'ops.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
