#!/usr/bin/env python3
"""Recipe stage 5: how the training loss fell, from the run's train_log.jsonl (about ten marks,
and the mean of the first vs the last tenth of the steps), and the dev evaluations
(lines with "event": "eval": dev loss, CER and, for space-delimited text, WER by step, the best step).

    python tools/loss_summary.py exp/tiny_cpu/train_log.jsonl
"""
from __future__ import annotations

import argparse
import json
import math


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def marks(points: list, k: int) -> list:
    """Every k-th point and the last one."""
    return [points[i] for i in range(0, len(points), k)] + ([points[-1]] if (len(points) - 1) % k else [])


def dev_summary(evals: list[dict]) -> list[str]:
    """Lines on the dev evaluations: loss (and CER, WER) by step, and the best of each."""
    loss = [(r["step"], r["cv_loss"]) for r in evals if _finite(r.get("cv_loss"))]
    rates = {name: [(r["step"], 100 * r[key]) for r in evals if _finite(r.get(key))]
             for name, key in (("CER", "cv_cer"), ("WER", "cv_wer"))}
    lines = []
    if loss:
        k = max(1, len(loss) // 10)
        lines.append("[run.sh] dev loss by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in marks(loss, k)))
    for name, points in rates.items():
        if points:
            k = max(1, len(points) // 10)
            lines.append(f"[run.sh] dev {name} by step: " + ", ".join(f"{s}: {v:.1f}%" for s, v in marks(points, k)))
    best = []
    if loss:
        s, v = min(loss, key=lambda sv: sv[1])
        best.append(f"dev loss {v:.3f} at step {s}")
    for name, points in rates.items():
        if points:
            s, v = min(points, key=lambda sv: sv[1])
            best.append(f"dev {name} {v:.2f}% at step {s}")
    if best:
        lines.append("[run.sh] best " + "; best ".join(best))
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train_log", help="DIR/train_log.jsonl written by west-train")
    a = p.parse_args(argv)
    with open(a.train_log, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if "event" not in r]   # lines with "event" are not training steps
    evals = [r for r in rows if r.get("event") == "eval"]
    loss = [(r["step"], r["loss"]) for r in steps if _finite(r.get("loss"))]
    if loss:
        k = max(1, len(loss) // 10)
        print("[run.sh] training loss by step: " + ", ".join(f"{s}: {v:.2f}" for s, v in marks(loss, k)))
        first = sum(v for _, v in loss[:k]) / k
        last = sum(v for _, v in loss[-k:]) / k
        print(f"[run.sh] mean loss of the first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    for line in dev_summary(evals):
        print(line)


if __name__ == "__main__":
    main()
