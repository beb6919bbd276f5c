"""Where the host's Python time goes in a training step: cProfile's per-function figures, per step.

The complement of :mod:`west.bench.trace_gaps`, which shows *that* the GPU waits for the host:
this shows what the launching thread was doing meanwhile, by function (own time and time
including callees). A builtin such as ``torch._C._nn.linear`` carries the C++ side of an operator
(dispatch, autograd recording, the launch); ``run_backward`` carries the whole backward, which
autograd runs on its own device thread, out of cProfile's sight, while this thread waits.
"""
from __future__ import annotations

import cProfile
import pstats
from typing import Callable

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


def profile_calls(fn: Callable[[], None]) -> pstats.Stats:
    """Run ``fn`` under cProfile (this thread only) and return its statistics."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    return pstats.Stats(prof)


def top_functions(stats: pstats.Stats, steps: int, top: int = 25) -> dict:
    """The ``top`` functions by own time, per step: calls, own ms, ms including callees; and the
    profiled time per step (the sum of all own times)."""
    rows = [dict(function=short_name(*key), calls=nc / steps, own_ms=tt * 1e3 / steps, total_ms=ct * 1e3 / steps)
            for key, (_, nc, tt, ct, _) in stats.stats.items()]
    rows.sort(key=lambda r: -r["own_ms"])
    return {"steps": steps, "profiled_ms_per_step": sum(r["own_ms"] for r in rows), "functions": rows[:top]}


def host_table(res: dict) -> str:
    """Markdown: the profiled time per step, then the top functions."""
    lines = [f"{res['steps']} steps, {res['profiled_ms_per_step']:.1f} ms of the launching thread per step "
             "(cProfile; its own overhead included)", "",
             "| function | calls per step | own ms per step | ms per step with callees |", "|---|---|---|---|"]
    lines += [f"| `{r['function']}` | {r['calls']:,.1f} | {r['own_ms']:.2f} | {r['total_ms']:.2f} |"
              for r in res["functions"]]
    return "\n".join(lines)
