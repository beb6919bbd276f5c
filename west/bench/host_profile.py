"""Where the host's Python time goes in a training step: cProfile's per-function figures, per step.

The complement of :mod:`west.bench.trace_gaps`, which shows *that* the GPU waits for the host:
this shows what the launching thread was doing meanwhile, by function (own time and time
including callees). A builtin such as ``torch._C._nn.linear`` carries the C++ side of an operator
(dispatch, autograd recording, the launch); ``run_backward`` carries the whole backward, which
on CUDA autograd runs on its own device thread, out of cProfile's sight, while this thread waits
(``tools/profile_step.py --single_thread_backward`` keeps it on this thread). The
garbage collector's pauses are timed beside (``gc.callbacks``): cProfile does not show them.
"""
from __future__ import annotations

import cProfile
import gc
import pstats
import time
from typing import Callable, Sequence

_ANCHORS = ("site-packages/", "/west/", "/tools/")


def short_name(filename: str, line: int, name: str) -> str:
    """``west/models/conformer.py:90(forward)``, ``transformers/...``, or a builtin's own name."""
    if filename == "~":
        return name
    for anchor in _ANCHORS:
        at = filename.rfind(anchor)
        if at >= 0:
            filename = filename[at + len(anchor):] if anchor == "site-packages/" else filename[at + 1:]
            break
    return f"{filename}:{line}({name})"


def profile_calls(fn: Callable[[], None]) -> tuple[pstats.Stats, list[tuple[int, float]]]:
    """Run ``fn`` under cProfile (this thread only): its statistics, and the garbage collector's
    pauses meanwhile as (generation, seconds)."""
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((int(info["generation"]), time.perf_counter() - started.pop()))

    prof = cProfile.Profile()
    gc.callbacks.append(on_gc)
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
        gc.callbacks.remove(on_gc)
    return pstats.Stats(prof), pauses


def top_functions(stats: pstats.Stats, steps: int, top: int = 25,
                  gc_pauses: Sequence[tuple[int, float]] = ()) -> dict:
    """The ``top`` functions by own time, per step: calls, own ms, ms including callees; west's own
    ``top`` functions by time including callees (where in the step the host's time goes: the
    encoder, the projector's and splice's index work, copies to the device); the profiled time per
    step (the sum of all own times); the collector's pauses per step by generation."""
    rows = [dict(function=short_name(*key), calls=nc / steps, own_ms=tt * 1e3 / steps, total_ms=ct * 1e3 / steps)
            for key, (_, nc, tt, ct, _) in stats.stats.items()]
    rows.sort(key=lambda r: -r["own_ms"])
    collections = {g: dict(count=sum(1 for k, _ in gc_pauses if k == g) / steps,
                           ms=sum(s for k, s in gc_pauses if k == g) * 1e3 / steps) for g in (0, 1, 2)}
    west = sorted((r for r in rows if r["function"].startswith("west/")), key=lambda r: -r["total_ms"])
    return {"steps": steps, "profiled_ms_per_step": sum(r["own_ms"] for r in rows), "functions": rows[:top],
            "west_by_total": west[:top], "gc_per_step": collections}


def host_table(res: dict) -> str:
    """Markdown: the profiled time per step, then the top functions."""
    gcs = ", ".join(f"generation {g}: {c['count']:.1f} ({c['ms']:.1f} ms)" for g, c in res["gc_per_step"].items())
    lines = [f"{res['steps']} steps, {res['profiled_ms_per_step']:.1f} ms of the launching thread per step "
             f"(cProfile; its own overhead included); garbage collections per step, {gcs}", "",
             "| function | calls per step | own ms per step | ms per step with callees |", "|---|---|---|---|"]
    row = "| `{function}` | {calls:,.1f} | {own_ms:.2f} | {total_ms:.2f} |".format
    lines += [row(**r) for r in res["functions"]]
    if res.get("west_by_total"):
        lines += ["", "west's functions by time with callees:", "",
                  "| function | calls per step | own ms per step | ms per step with callees |", "|---|---|---|---|"]
        lines += [row(**r) for r in res["west_by_total"]]
    return "\n".join(lines)
