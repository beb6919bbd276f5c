#!/usr/bin/env python3
"""Dispatched aten operators per training step, per batch mode: the launch count of issue 23, any device.

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
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Any config key can be overridden as --section.key VALUE, as in west-train.")
    p.add_argument("--config", required=True)
    p.add_argument("--data", required=True, help="jsonl data list to draw the utterances from")
    p.add_argument("--num_utts", type=int, required=True)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--modes", default="static,dynamic,pack,pack_encoder_padded")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--max_tokens_in_batch", type=int, default=4096)
    p.add_argument("--pack_tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    args, rest = p.parse_known_args(argv)

    import torch

    from west.bench.benchmark import load_batches
    from west.bench.modes import model_overrides, select_utterances, standard_modes
    from west.bench.op_counter import count_encoder_ops, count_step_ops
    from west.bench.report import ops_table
    from west.bench.runner import PassRunner
    from west.config import load_config, split_overrides
    from west.host_memory import keep_freed_host_memory
    from west.models.llm import load_tokenizer
    from west.ranks import resolved_device
    from west.train.build import build_model

    cfg = load_config(args.config, split_overrides(rest))
    modes = standard_modes([m for m in args.modes.split(",") if m], args.batch_size, args.max_tokens_in_batch,
                           args.pack_tokens)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    subset = out / "ops_data.list"
    select_utterances(args.data, args.num_utts, subset, args.seed)
    device = torch.device(resolved_device(cfg.train.device))
    if device.type == "cpu":
        keep_freed_host_memory()
    tokenizer = load_tokenizer(cfg.model.llm.path)
    model = build_model(cfg.model, args.seed).to(device)
    runner = PassRunner(model, cfg.train, device, args.seed)
    shape = model.cfg.speech_shape()
    results = {}
    for m in modes:
        t0 = time.perf_counter()
        conf = dataclasses.replace(cfg.data, **m.data, num_workers=0)
        batches, _, _ = load_batches(str(subset), tokenizer, conf, shape, args.seed)
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
