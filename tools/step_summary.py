#!/usr/bin/env python3
"""One table row from a west-train log: the steady-state step of a run (tools/gpu_suite.sh).

Reads DIR/train_log.jsonl, drops the first ``--skip`` steps (warm-up, compilation) and prints
the medians: step time, utterances and real LLM tokens per second, loader wait, GPU busy and
SM % (NVML, when sampled), peak allocated and (CUDA) reserved memory, and the host's split of the
step (queueing forward/backward/clip, then blocked in the step's one read-back: near 0 on a GPU
when the host paces the step), and the mean per step of the CUDA caching allocator's device allocations and
flush-and-retry events (0 in a steady state), and a line of the host's figures (the launching
thread's time on a core, in the kernel and waiting for one, autograd's threads', the hypervisor's
steal, the cgroup's throttling: west.lab.host_clock). A run with ``python -m west.lab.train --phase_marks`` also gets its
phases' table: host and GPU ms per phase and how far the host was ahead of the GPU, and the time
each step spent outside its phases and the loader's wait. Not a test.

    python tools/step_summary.py exp/run/train_log.jsonl --name pack --skip 5
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

from west.lab.host_clock import HOST_KEYS, host_line
from west.lab.phase_table import lag_table
from west.lab.phase_table import summarize as phase_summary

COLUMNS = (("step_time_s", "step s", "{:.3f}"), ("utts_per_s", "utts/s", "{:.0f}"),
           ("tokens_per_s", "LLM tokens/s", "{:,.0f}"), ("data_wait_s", "loader wait s", "{:.4f}"),
           ("gpu_busy_pct", "GPU busy %", "{:.0f}"), ("gpu_sm_pct", "SM %", "{:.0f}"),
           ("peak_mem_mb", "peak GiB", "{:.1f}"), ("peak_reserved_mb", "reserved GiB", "{:.1f}"),
           ("launch_s", "host launch s", "{:.3f}"), ("sync_wait_s", "sync wait s", "{:.3f}"),
           ("device_allocs", "device allocs", "{:.1f}"),
           ("alloc_retries", "alloc retries", "{:.1f}"))
EVENTS = ("device_allocs", "alloc_retries")   # rare events: the mean per step (a median hides them)


def summarize(path: Path, skip: int) -> dict:
    steps = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    steps = [s for s in steps if "event" not in s and s.get("status") == "ok"][skip:]
    if not steps:
        raise SystemExit(f"{path}: no optimizer steps after the first {skip}")
    out = {"steps": len(steps)}
    for key, _, _ in COLUMNS:
        values = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
        out[key] = (statistics.fmean if key in EVENTS else statistics.median)(values) if values else None
    host = {}   # the host's figures (west.lab.host_clock): means per step
    for key in HOST_KEYS:
        values = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
        if values:
            host[key] = statistics.fmean(values)
    stalls = [x for x in map(stalled_ms, steps) if x is not None]
    if stalls:
        host["stalled_ms"] = statistics.fmean(stalls)
    if host:
        out["host"] = host
    for key in ("peak_mem_mb", "peak_reserved_mb"):   # the most over the run, in GiB
        if out[key] is not None:
            out[key] = max(s[key] for s in steps if isinstance(s.get(key), (int, float))) / 1024
    marked = [s for s in steps if "phase_marks" in s]
    if marked:   # west.lab.train --phase_marks: the phases' medians (west.lab.phase_table)
        out["phase_marks"] = phase_summary([s["phase_marks"]["phases"] for s in marked],
                                           gpu=marked[0]["phase_marks"]["gpu"])
        out["outside_ms"] = statistics.median(outside_phases_ms(s) for s in marked)
    return out


def stalled_ms(step: dict) -> Optional[float]:
    """A step's wall time in which its launching thread was blocked, but neither on the loader's queue
    nor on autograd's threads (their time on a core stands for its wait on them): a lock (Python's,
    the driver's), a blocking call, the machine. A read-back on CUDA spins on a core, so it counts as
    on a core. None without the thread's figures (west.lab.host_clock)."""
    if not all(isinstance(step.get(k), (int, float)) for k in ("host_cpu_ms", "host_runqueue_ms")):
        return None
    return (1e3 * (step["step_time_s"] - (step.get("data_wait_s") or 0.0)) - step["host_cpu_ms"]
            - step["host_runqueue_ms"] - (step.get("autograd_cpu_ms") or 0.0))


def outside_phases_ms(step: dict) -> float:
    """A marked step's time in neither its phases nor the loader's wait: the loop's own work around
    the step (planning it, placing the hooks, reading the marks back). Medians of the step and of
    its phases do not subtract; this is taken step by step."""
    phases_ms = sum(p["host_ms"] for p in step["phase_marks"]["phases"])
    return 1e3 * (step["step_time_s"] - (step.get("data_wait_s") or 0.0)) - phases_ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path)
    p.add_argument("--name", default="run")
    p.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up, compilation)")
    a = p.parse_args(argv)
    s = summarize(a.log, a.skip)
    head = "| run | steps | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    cells = [fmt.format(s[key]) if s[key] is not None else "–" for key, _, fmt in COLUMNS]
    print(f"{head}\n|{'---|' * (len(COLUMNS) + 2)}\n| {a.name} | {s['steps']} | " + " | ".join(cells) + " |")
    if "host" in s:
        h = s["host"]
        stalled = f"; the launching thread blocked otherwise: {h['stalled_ms']:.1f}" if "stalled_ms" in h else ""
        print(f"the host's ms per step (means): {host_line(h)}{stalled}")
    if "phase_marks" in s:
        print(f"\n{a.name}, phase by phase (west.lab.train --phase_marks):\n\n{lag_table(s['phase_marks'])}\n"
              f"outside the phases and the loader's wait: {s['outside_ms']:.1f} ms per step (median over steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
