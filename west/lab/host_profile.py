"""Where the host's Python time goes in a training step: cProfile's per-function figures, per step.

The complement of :mod:`west.lab.trace_gaps`, which shows *that* the GPU waits for the host:
this shows what the launching thread was doing meanwhile, by function (own time and time
including callees). A builtin such as ``torch._C._nn.linear`` carries the C++ side of an operator
(dispatch, autograd recording, the launch); ``run_backward`` carries the whole backward, which
on CUDA autograd runs on its own device thread, out of cProfile's sight, while this thread waits
(``tools/profile_step.py --single_thread_backward`` keeps it on this thread). The
garbage collector's pauses are timed beside (``gc.callbacks``): cProfile does not show them.
"""
from __future__ import annotations

import cProfile
import functools
import gc
import os
import pstats
import time
from typing import Callable, Sequence

import west

# West's code is what lies in the imported package's directory, found from where it really is: a
# fragment such as "/west/" would also match every file of a checkout named west (git clone's default
# directory), its tests and tools included.
_PACKAGE = os.path.dirname(os.path.realpath(west.__file__))
_CHECKOUT = os.path.dirname(_PACKAGE)   # the directory holding the package: tools/, tests/ of a checkout


@functools.lru_cache(maxsize=None)
def _place(filename: str) -> tuple[str, bool]:
    """A code file's short name and whether it is west's: relative to the package's parent for a
    file in west's package, after ``site-packages/`` for an installed library, relative to the
    checkout for its other files (``tools/...``), else the whole path."""
    if filename.startswith("<"):                 # <frozen ...>, <string>: no file
        return filename, False
    real = os.path.realpath(filename)
    if real.startswith(_PACKAGE + os.sep):
        return os.path.relpath(real, _CHECKOUT), True
    at = filename.rfind("site-packages/")
    if at >= 0:
        return filename[at + len("site-packages/"):], False
    if real.startswith(_CHECKOUT + os.sep):
        return os.path.relpath(real, _CHECKOUT), False
    return filename, False


def is_west(filename: str) -> bool:
    """Whether a code file is part of the imported west package (by its real location)."""
    return filename != "~" and _place(filename)[1]


def short_name(filename: str, line: int, name: str) -> str:
    """``west/models/conformer.py:90(forward)``, ``transformers/...``, or a builtin's own name."""
    if filename == "~":
        return name
    return f"{_place(filename)[0]}:{line}({name})"


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
    found = [(dict(function=short_name(*key), calls=nc / steps, own_ms=tt * 1e3 / steps, total_ms=ct * 1e3 / steps),
              is_west(key[0])) for key, (_, nc, tt, ct, _) in stats.stats.items()]
    rows = [r for r, _ in found]
    rows.sort(key=lambda r: -r["own_ms"])
    collections = {g: dict(count=sum(1 for k, _ in gc_pauses if k == g) / steps,
                           ms=sum(s for k, s in gc_pauses if k == g) * 1e3 / steps) for g in (0, 1, 2)}
    west_rows = sorted((r for r, ours in found if ours), key=lambda r: -r["total_ms"])
    return {"steps": steps, "profiled_ms_per_step": sum(r["own_ms"] for r in rows), "functions": rows[:top],
            "west_by_total": west_rows[:top], "gc_per_step": collections}


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
