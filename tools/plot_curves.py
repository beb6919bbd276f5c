#!/usr/bin/env python3
"""Training curves of a west-train run as a PNG: train loss, dev loss and dev CER (WER) over steps.

    python tools/plot_curves.py exp/tiny_cpu [--out exp/tiny_cpu/curves.png]

Reads RUN_DIR/train_log.jsonl: lines without "event" are training steps (loss drawn raw
and smoothed), lines with "event": "eval" are dev evaluations (cv_loss, and cv_cer and cv_wer
on a second panel when the run decoded dev utterances). Prints the PNG's path.
Exit status 2 when the log is missing or holds no losses.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def read_log(path: Path) -> tuple[list[tuple[int, float]], list[dict]]:
    """(train (step, loss) pairs, eval lines), each sorted by step, one per step (the last
    line wins: a resumed run re-logs the steps after its checkpoint); torn lines are skipped."""
    steps: dict[int, float] = {}
    evals: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):
                continue
            if row.get("event") == "eval":
                evals[step] = row
            elif "event" not in row and _finite(row.get("loss")):
                steps[step] = float(row["loss"])
    return sorted(steps.items()), [evals[s] for s in sorted(evals)]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _mark_best(ax, point: tuple[int, float], text: str, color: str, dy: int = 8) -> None:
    """Label the best dev point, to its left when it is near the right edge (``dy`` < 0: below)."""
    right = point[0] >= 0.8 * max(ax.get_xlim()[1], 1)
    ax.annotate(text, point, textcoords="offset points", xytext=(-4 if right else 4, dy),
                ha="right" if right else "left", fontsize=8, color=color)


def plot_curves(run_dir: Path, out: Path) -> Path:
    """Write the PNG; raises FileNotFoundError / ValueError with a message for the user."""
    log = run_dir / "train_log.jsonl"
    if not log.is_file():
        raise FileNotFoundError(f"{log} is missing: not a west-train run dir, or no step was logged yet")
    train, evals = read_log(log)
    dev_loss = [(int(r["step"]), float(r["cv_loss"])) for r in evals if _finite(r.get("cv_loss"))]
    dev_cer = [(int(r["step"]), 100 * float(r["cv_cer"])) for r in evals if _finite(r.get("cv_cer"))]
    dev_wer = [(int(r["step"]), 100 * float(r["cv_wer"])) for r in evals if _finite(r.get("cv_wer"))]
    if not train and not dev_loss:
        raise ValueError(f"{log}: no training loss and no dev loss to plot")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = 2 if dev_cer else 1
    fig, axes = plt.subplots(rows, 1, figsize=(8, 3.2 * rows + 0.6), sharex=True, squeeze=False)
    ax = axes[0][0]
    if train:
        x, y = zip(*train)
        window = max(1, len(y) // 25)
        ax.plot(x, y, color="tab:blue", alpha=0.25 if window > 1 else 1.0, linewidth=0.8 if window > 1 else 1.4,
                label="train loss")
        if window > 1:
            ax.plot(x, smooth(list(y), window), color="tab:blue", linewidth=1.6,
                    label=f"train loss (mean of {window} steps)")
    if dev_loss:
        x, y = zip(*dev_loss)
        ax.plot(x, y, "o-", color="tab:orange", markersize=3.5, linewidth=1.4, label="dev loss")
        best = min(dev_loss, key=lambda sv: sv[1])
        _mark_best(ax, best, f"best {best[1]:.3f} @ {best[0]}", "tab:orange", dy=-14)
    losses = [v for _, v in train + dev_loss]
    if losses and min(losses) > 0 and max(losses) > 20 * min(losses):  # a fall over decades: log scale
        ax.set_yscale("log")
    ax.set_ylabel("loss (per token)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"{run_dir.resolve().name}: training curves")
    if dev_cer:
        ax2 = axes[1][0]
        x, y = zip(*dev_cer)
        n = next((r.get("cv_decoded_utts") for r in reversed(evals) if r.get("cv_decoded_utts")), None)
        ax2.plot(x, y, "s-", color="tab:green", markersize=3.5, linewidth=1.4,
                 label="dev CER" + (f" (first {n} utterances, greedy)" if n else ""))
        best = min(dev_cer, key=lambda sv: sv[1])
        _mark_best(ax2, best, f"best {best[1]:.2f}% @ {best[0]}", "tab:green")
        top = max(y)
        if dev_wer:   # space-delimited text: the word error rate beside the character one
            x, y = zip(*dev_wer)
            ax2.plot(x, y, "^-", color="tab:purple", markersize=3.5, linewidth=1.4, label="dev WER")
            best = min(dev_wer, key=lambda sv: sv[1])
            _mark_best(ax2, best, f"best {best[1]:.2f}% @ {best[0]}", "tab:purple", dy=20)
            top = max(top, max(y))
        ax2.set_ylabel("CER / WER (%)" if dev_wer else "CER (%)")
        ax2.set_ylim(0, 1.15 * top or 1.0)   # from 0, with room for the label of the best point
        ax2.grid(alpha=0.3)
        ax2.legend(loc="upper right", fontsize=8)
    axes[-1][0].set_xlabel("optimizer step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(y=0.12)   # room for the label of the best dev loss
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="west-train output dir (train_log.jsonl)")
    p.add_argument("--out", type=Path, help="PNG to write [RUN_DIR/curves.png]")
    a = p.parse_args(argv)
    try:
        out = plot_curves(a.run_dir, a.out or a.run_dir / "curves.png")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
