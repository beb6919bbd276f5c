#!/usr/bin/env python3
"""A training step's floor at a GPU's copy bandwidth and product peak, counted on the CPU.

Counts the first ``--batches`` batches of a config's epoch through the production forward and
backward on the meta device at the LLM's real widths (west.lab.roofline): every operator's bytes
and FLOPs as CUDA dispatches them, each operator's floor (the longer of moving its bytes and doing
its FLOPs), summed per category and per operator, and the MFU no schedule of these operators can
beat. The LLM is built from ``--llm``'s config.json alone (no weights are read; tools/make_seed_llm.py
--config_only writes one with the tokenizer). Prints the table, writes OUT_DIR/roofline.{md,json}.

    python tools/step_roofline.py --config recipes/aishell/conf/seed_gpu.yaml --llm exp/seed_llm_config \\
        --data data/train/data.list --data.cmvn data/train/global_cmvn.json --out_dir exp/roofline \\
        --model.llm.gradient_checkpointing false
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

# H100 SXM: HBM3 at 3.35 TB/s by its datasheet, of which a device-to-device copy reaches about 90 %;
# the bf16 8192^3 product measured 790.84 TFLOP/s in run 7 (docs/notebook.md)
BANDWIDTH_GB_S = 3000.0
PEAK_TFLOP_S = 790.84


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Any config key can be overridden as --section.key VALUE, as in west-train.")
    p.add_argument("--config", required=True)
    p.add_argument("--llm", required=True, help="directory with the LLM's config.json and tokenizer")
    p.add_argument("--data", required=True, help="jsonl data list (the first batches of its epoch 0 are counted)")
    p.add_argument("--num_utts", type=int, default=0,
                   help="draw this many utterances as west-benchmark does (same --seed: the same batches); 0: the whole list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, default=0, help="count the first N batches (0: all of them)")
    p.add_argument("--bandwidth_gb_s", type=float, default=BANDWIDTH_GB_S)
    p.add_argument("--peak_tflop_s", type=float, default=PEAK_TFLOP_S)
    p.add_argument("--measured_step_s", type=float, default=0.0, help="a measured step to set the floor against")
    p.add_argument("--kernels", default=None,
                   help="tools/profile_step.py --kernels_only JSON of the same configuration: its kernel time "
                        "per category set against the floor's")
    p.add_argument("--kernels_mode", default="pack", help="the mode of --kernels to read")
    p.add_argument("--out_dir", required=True)
    args, rest = p.parse_known_args(argv)

    import torch
    from tqdm import tqdm

    from west.bench.modes import select_utterances
    from west.config import load_config, split_overrides
    from west.data.dataset import build_dataloader
    from west.lab.kernel_kinds import category_table
    from west.lab.roofline import floors_ms, meta_model, step_floor, table, totals
    from west.models.llm import load_tokenizer

    cfg = load_config(args.config, split_overrides(["--model.llm.path", args.llm, *rest]))
    if cfg.data.batch_type != "pack":   # padded batches take the masked SDPA path: no kernel stands in for it
        raise SystemExit(f"step_roofline: counts pack steps (the cu_seqlens kernels); data.batch_type is "
                         f"{cfg.data.batch_type!r}: give --data.batch_type pack")
    model = meta_model(cfg.model, args.llm)
    tok = load_tokenizer(args.llm)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = args.data
    if args.num_utts:
        data = str(out / "roofline_data.list")
        select_utterances(args.data, args.num_utts, Path(data), args.seed)
    conf = dataclasses.replace(cfg.data, num_workers=0, pin_memory=False)
    loader, _ = build_dataloader(data, tok, conf, model.shape, seed=args.seed, epoch=0, training=True)
    t0 = time.perf_counter()
    batches = itertools.islice(loader, args.batches) if args.batches else loader
    steps = [step_floor(model, b, args.bandwidth_gb_s * 1e9, args.peak_tflop_s * 1e12)
             for b in tqdm(batches, total=args.batches or None, desc="roofline", leave=False)]
    if not steps:
        raise SystemExit(f"step_roofline: {args.data} gave no batch")
    text = table(steps, measured_step_s=args.measured_step_s or None)
    if args.kernels:
        profiled = json.loads(Path(args.kernels).read_text(encoding="utf-8"))
        mode = profiled["modes"][args.kernels_mode]
        text += (f"\n\nKernels of {args.kernels} ({args.kernels_mode}, {profiled['device']}, {mode['steps']} steps, "
                 f"{mode['step_ms']:.1f} ms per step, GPU busy {mode['gpu_busy_pct']:.0f} %) against the floor:\n\n"
                 + category_table(mode["by_category"], floors_ms(steps)))
    command = " ".join(["python tools/step_roofline.py", *(argv if argv is not None else sys.argv[1:])])
    note = (f"{len(steps)} batches of {data} ({sum(s['utterances'] or 0 for s in steps)} utterances, "
            f"{cfg.data.batch_type} {cfg.data.pack_tokens if cfg.data.batch_type == 'pack' else ''}), "
            f"torch {torch.__version__}; `{command}`")
    (out / "roofline.md").write_text(f"{text}\n\n{note}\n", encoding="utf-8")
    res = {"steps": steps, "totals": totals(steps), "command": command, "torch": torch.__version__}
    (out / "roofline.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    print(text)
    whole = res["totals"]["whole"]
    print(f"[step_roofline] {len(steps)} steps counted in {time.perf_counter() - t0:.0f} s: floor "
          f"{whole['floor_s'] / len(steps) * 1e3:.0f} ms per step; wrote {out / 'roofline.md'}, {out / 'roofline.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
