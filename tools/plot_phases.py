#!/usr/bin/env python3
"""A training step's phases as a picture: two lanes, the host and the GPU, per batch mode.

    python tools/plot_phases.py marks.json [--out phases.png]          # tools/profile_step.py --phase_marks
    python tools/plot_phases.py exp/run/train_log.jsonl [--skip 5]      # west-train with python -m west.lab.train --phase_marks

Each phase is a bar on the host's lane, from where the host began it to where it ended (the
medians of west.lab.phase_marks, laid end to end), and a bar on the GPU's lane shifted by how
far the host was ahead at its start and end. Where the GPU's bar starts at the host's, the GPU
was waiting for the host. On a CPU there is one lane: the operators run when they are called.
Prints the PNG's path; exit status 2 when the input holds no phase marks.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from west.lab.phase_table import summarize


def read_marks(path: Path, skip: int = 5) -> dict[str, dict]:
    """{name: summarize()'s result}: every mode of a profile_step JSON, or the run of a train_log.jsonl
    (its steps after the first ``skip``)."""
    if path.suffix == ".jsonl":
        steps = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        marked = [s["phase_marks"] for s in steps if "phase_marks" in s][skip:]
        if not marked:
            return {}
        return {path.parent.name: summarize([m["phases"] for m in marked], gpu=marked[0]["gpu"])}
    modes = json.loads(path.read_text(encoding="utf-8")).get("modes", {})
    return {name: r["phase_marks"] for name, r in modes.items() if "phase_marks" in r}


def lanes(res: dict) -> list[dict]:
    """Per phase: host start and end, GPU start and end (ms from the step's start)."""
    out, t = [], 0.0
    for p in res["phases"]:
        end = t + p["host_ms"]
        out.append({"phase": p["phase"], "host": (t, end), "gpu": (t + p["lag_start_ms"], end + p["lag_end_ms"])})
        t = end
    return out


def plot_phases(marks: dict[str, dict], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(p["phase"] for res in marks.values() for p in res["phases"]))
    colors = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    legend_in = 0.25 * -(-len(names) // 5) + 0.15   # inches under the axes for the legend's rows
    height = 1.2 + 1.3 * len(marks) + legend_in
    fig, axes = plt.subplots(len(marks), 1, figsize=(11, height), squeeze=False)
    for ax, (mode, res) in zip(axes[:, 0], marks.items()):
        rows = ["host", "GPU"] if res["gpu"] else ["host"]
        for span in lanes(res):
            for y, lane in enumerate(rows):
                a, b = span["host" if lane == "host" else "gpu"]
                ax.barh(y, b - a, left=a, color=colors[span["phase"]], edgecolor="white", linewidth=0.4)
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        paced = f", {res['host_paced_ms']:.0f} ms paced by the host" if res["gpu"] else " (no GPU: host only)"
        ax.set_title(f"{mode}: {res['step_ms']:.0f} ms per step{paced}", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from the step's start (medians over steps)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    fig.legend(handles, names, loc="lower center", ncol=5, fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("marks", type=Path, help="a profile_step --phase_marks JSON or a train_log.jsonl")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: beside the input, phases.png)")
    p.add_argument("--skip", type=int, default=5, help="train_log.jsonl: first steps left out (warm-up)")
    a = p.parse_args(argv)
    marks = read_marks(a.marks, a.skip) if a.marks.is_file() else {}
    if not marks:
        print(f"[plot_phases] {a.marks}: no phase marks (tools/profile_step.py --phase_marks, python -m west.lab.train --phase_marks)",
              file=sys.stderr)
        return 2
    out = plot_phases(marks, a.out or a.marks.with_name("phases.png"), f"{a.marks.name}: a step's phases")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
