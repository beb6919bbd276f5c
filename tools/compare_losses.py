#!/usr/bin/env python3
"""Two west-train runs of the same data and seed, step by step: their losses side by side and the
largest relative difference (tools/gpu_suite.sh, part ``encoder_graphs_exact``: a change that should
compute the same function, such as replaying the encoder from CUDA graphs, with dropout off).

On a GPU in bf16 the runs differ by rounding, which training amplifies over the steps; the first
steps say whether the function is the same. Not a test: ``--rtol`` only sets the exit status.

    python tools/compare_losses.py exp/a/train_log.jsonl exp/b/train_log.jsonl --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def step_losses(path: Path) -> dict[int, float]:
    """{step: loss} of the optimizer steps a west-train log recorded."""
    out = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "event" in rec or rec.get("status") != "ok":
            continue
        if not isinstance(rec.get("step"), int) or not isinstance(rec.get("loss"), (int, float)):
            raise SystemExit(f"{path}:{n}: a step record without an integer 'step' and a numeric 'loss'")
        out[rec["step"]] = float(rec["loss"])
    if not out:
        raise SystemExit(f"{path}: no optimizer steps")
    return out


def compare(a: dict[int, float], b: dict[int, float]) -> dict:
    """Per shared step: both losses and |b - a| / |a|; the largest, and the steps only one run has."""
    steps = sorted(set(a) & set(b))
    rows = [{"step": s, "a": a[s], "b": b[s], "rel": abs(b[s] - a[s]) / max(abs(a[s]), 1e-12)} for s in steps]
    worst = max(rows, key=lambda r: r["rel"]) if rows else None
    return {"rows": rows, "worst": worst, "only_a": sorted(set(a) - set(b)), "only_b": sorted(set(b) - set(a))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="the reference run's train_log.jsonl")
    ap.add_argument("b", type=Path, help="the other run's train_log.jsonl")
    ap.add_argument("--json", type=Path, help="write the comparison here")
    ap.add_argument("--rtol", type=float, help="exit 1 when a step's losses differ by more than this")
    args = ap.parse_args(argv)
    res = compare(step_losses(args.a), step_losses(args.b))
    res.update(a=str(args.a), b=str(args.b))
    print(f"| step | {args.a.parent.name} loss | {args.b.parent.name} loss | relative difference |")
    print("|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['step']} | {r['a']:.5f} | {r['b']:.5f} | {r['rel']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1), encoding="utf-8")
    if res["worst"] is None:
        print("[compare_losses] no step in both runs")
        return 1
    w, first = res["worst"], res["rows"][0]
    extra = f"; steps in one run only: {res['only_a'] or res['only_b']}" if res["only_a"] or res["only_b"] else ""
    print(f"[compare_losses] {len(res['rows'])} steps: largest relative difference {w['rel']:.1e} (step {w['step']}), "
          f"at step {first['step']} {first['rel']:.1e}{extra}")
    return 1 if args.rtol is not None and (w["rel"] > args.rtol or extra) else 0


if __name__ == "__main__":
    sys.exit(main())
