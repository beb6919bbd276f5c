"""The phases of a marked training step as tables: each phase's host and GPU time and the lag at its
ends, medians over steps, and the markdown that reads them. Plain Python, no torch: the scripts that
read a run's log (tools/step_summary.py after every west-train run of tools/gpu_suite.sh, where
importing torch costs seconds each time) use it; west.lab.phase_marks drops the marks."""
from __future__ import annotations

import statistics

from west.train.phases import ENCODER_OUTPUT, LLM_INPUT, LLM_OUTPUT

# What runs from each boundary to the next, in a packed step's order (a mark names what it starts).
PHASE_NAMES = {
    "step": "batch to device", "forward": "input embeddings", "forward/encoder": "encoder forward",
    "after forward/encoder": "encoder rows", "forward/projector": "projector",
    "after forward/projector": "splice", "forward/llm": "LLM forward", "after forward/llm": "loss",
    "after forward": "loss backward", LLM_OUTPUT: "LLM backward", LLM_INPUT: "splice, projector backward",
    ENCODER_OUTPUT: "encoder backward, clip, read-back", "optimizer": "optimizer",
    "after optimizer": "step end", "end": "end",
}


def phases(marks: list[tuple[str, float, float]]) -> list[dict]:
    """Consecutive marks of one step -> one phase each, named by :data:`PHASE_NAMES` for the mark
    that opens it: host ms, GPU ms (the span between the GPU reaching its two marks, idle included)
    and the lag at its start and end (GPU time minus host time at the mark)."""
    out = []
    for (a, ha, ga), (_, hb, gb) in zip(marks, marks[1:]):
        out.append({"phase": PHASE_NAMES.get(a, a), "host_ms": hb - ha, "gpu_ms": gb - ga,
                    "lag_start_ms": ga - ha, "lag_end_ms": gb - hb})
    return out


def summarize(steps: list[list[dict]], gpu: bool, paced_ms: float = 0.5) -> dict:
    """Medians over steps, phase by phase, of the steps with the most common sequence of phases
    (a step of dummy batches, without speech, has fewer; ``left_out`` counts the others). On a GPU
    a phase is *host-paced* when its lag is under ``paced_ms`` at both ends: the GPU waited on the
    host when it began and again when it ended. Without one (``gpu`` false) there is no lag to read:
    ``host_paced`` is None. ``median_step``: the kept step of median host time, whole (its index
    among ``steps`` and its phases), where each phase's lag at its end is its lag at its start plus
    its GPU time less its host time, as the separate medians need not be."""
    if not steps:
        raise ValueError("no steps to summarize")
    sequences = [tuple(p["phase"] for p in s) for s in steps]
    names = max(sequences, key=sequences.count)
    kept = [s for s, seq in zip(steps, sequences) if seq == names]
    rows = []
    for i, name in enumerate(names):
        row = {"phase": name}
        for key in ("host_ms", "gpu_ms", "lag_start_ms", "lag_end_ms"):
            row[key] = statistics.median(s[i][key] for s in kept)
        row["host_paced"] = (row["lag_start_ms"] < paced_ms and row["lag_end_ms"] < paced_ms) if gpu else None
        rows.append(row)
    paced = sum(r["host_ms"] for r in rows if r["host_paced"]) if gpu else None
    # the columns' medians come from different steps, so their lags need not add up; one whole step does
    middle = sorted(kept, key=lambda s: sum(p["host_ms"] for p in s))[len(kept) // 2]
    return {"steps": len(kept), "left_out": len(steps) - len(kept), "gpu": gpu,
            "step_ms": sum(r["host_ms"] for r in rows), "host_paced_ms": paced, "paced_below_ms": paced_ms,
            "phases": rows, "median_step": {"step": steps.index(middle), "phases": middle}}


def lag_table(res: dict) -> str:
    """Markdown table of :func:`summarize`'s result, and one line that reads it."""
    if not res["gpu"]:
        lines = ["| phase | host ms |", "|---|---|"]
        lines += [f"| {r['phase']} | {r['host_ms']:.1f} |" for r in res["phases"]]
        lines += ["", f"{res['steps']} steps, medians: {res['step_ms']:.1f} ms per step (no GPU: the host's time alone)"]
        return "\n".join(lines)
    lines = ["| phase | host ms | GPU ms (span) | host ahead at start, ms | at end, ms | paced by the host |",
             "|---|---|---|---|---|---|"]
    for r in res["phases"]:
        lines.append(f"| {r['phase']} | {r['host_ms']:.1f} | {r['gpu_ms']:.1f} | {r['lag_start_ms']:.1f} | "
                     f"{r['lag_end_ms']:.1f} | {'yes' if r['host_paced'] else ''} |")
    lines.append("")
    other = f" ({res['left_out']} with other phases left out)" if res.get("left_out") else ""
    lines.append(f"{res['steps']} steps{other}, medians: {res['step_ms']:.1f} ms per step, "
                 f"{res['host_paced_ms']:.1f} ms of it in phases the host paces "
                 f"(the GPU less than {res['paced_below_ms']} ms behind at both ends)")
    middle = res.get("median_step")
    if middle:
        total = sum(p["host_ms"] for p in middle["phases"])
        lines += ["", f"the step of median host time alone (step {middle['step']} of those read, {total:.1f} ms), "
                      "whose lags add up phase to phase:", "",
                  "| phase | host ms | GPU ms (span) | host ahead at start, ms | at end, ms |", "|---|---|---|---|---|"]
        lines += [f"| {p['phase']} | {p['host_ms']:.1f} | {p['gpu_ms']:.1f} | {p['lag_start_ms']:.1f} | "
                  f"{p['lag_end_ms']:.1f} |" for p in middle["phases"]]
    return "\n".join(lines)
