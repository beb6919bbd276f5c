#!/usr/bin/env python3
"""Stage 5: how the training loss fell, from the run's train_log.jsonl (about ten marks,
and the mean of the first vs the last tenth of the steps).

    python local/loss_summary.py exp/tiny_cpu/train_log.jsonl
"""
from __future__ import annotations

import argparse
import json
import math


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train_log", help="DIR/train_log.jsonl written by west-train")
    a = p.parse_args(argv)
    with open(a.train_log, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    loss = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None and math.isfinite(r["loss"])]
    if not loss:
        return
    k = max(1, len(loss) // 10)
    marks = [loss[i] for i in range(0, len(loss), k)] + ([loss[-1]] if (len(loss) - 1) % k else [])
    print("[run.sh] training loss by step: " + ", ".join(f"{s}: {v:.2f}" for s, v in marks))
    first = sum(v for _, v in loss[:k]) / k
    last = sum(v for _, v in loss[-k:]) / k
    print(f"[run.sh] mean loss of the first {k} steps {first:.3f} -> last {k} steps {last:.3f}")


if __name__ == "__main__":
    main()
