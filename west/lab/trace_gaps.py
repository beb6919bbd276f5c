"""Where a GPU step waits for the host: busy time, and the phase and operator behind each idle gap.

Reads the events of a torch.profiler Chrome trace (``prof.export_chrome_trace``). A host-bound
step shows up as gaps between the GPU's kernels: the GPU has finished what it was given and
waits for the next launch. Each gap is charged to the launch that ended it: the phase the host
was in when it made that launch (the innermost ``west:`` range: ``tools/profile_step.py`` opens
them around the step, the forward, its encoder, projector and LLM, and the optimizer), and the
innermost aten operator around the launch on the launching thread. The time outside the forward
and the optimizer but inside a step is the backward (with clipping and the step's figures):
``REST``.

:func:`kernel_timeline` reads a kernels-only trace instead (no CPU operators recorded, so the
host runs at nearly its own speed): busy time, and each idle gap as *host late* (the launch that
ended it came after the GPU went idle) or *queued*, by length, with the runtime calls inside them.

Pure functions on event dicts, so they are tested on the CPU with synthetic traces; a CPU
trace has no GPU events and yields phase times alone.
"""
from __future__ import annotations

import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional, Sequence

from west.lab.kernel_kinds import by_category, category_table

PREFIX = "west:"
STEP = PREFIX + "step"
REST = "backward, clip, figures"   # in a step, outside the forward and optimizer ranges
FORWARD_OTHER = "forward, other (embeddings, loss)"   # in the forward, outside encoder, projector, LLM
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def load_events(path: Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace file."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted, disjoint intervals covering the same time."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def clip(spans: Sequence[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]


class Innermost:
    """The innermost of properly nested ranges containing a time: the latest-starting one
    that still contains it (ranges on one thread nest; of two starting together, the shorter).
    Each range keeps its enclosing one, so a query walks up the nesting, not back over siblings."""

    def __init__(self, ranges: Iterable[tuple[float, float, str]]):
        self.ranges = sorted(ranges, key=lambda r: (r[0], -r[1]))
        self.starts = [r[0] for r in self.ranges]
        self.parent: list[int] = []
        open_: list[int] = []
        for i, (s, e, _) in enumerate(self.ranges):
            while open_ and self.ranges[open_[-1]][1] < s:
                open_.pop()
            self.parent.append(open_[-1] if open_ else -1)
            open_.append(i)

    def at(self, t: float) -> Optional[str]:
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0:
            s, e, name = self.ranges[i]
            if e >= t:
                return name
            i = self.parent[i]
        return None


def exclusive_ms(ann: Sequence[dict], phases: Innermost) -> dict[str, float]:
    """Host wall time in which each phase is the innermost open range, and the time between steps
    as "outside a step": they sum to the window from the first step's start to the last one's end."""
    cuts = sorted({t for e in ann for t in (e["ts"], e["ts"] + e["dur"])})
    out: dict[str, float] = defaultdict(float)
    for a, b in zip(cuts, cuts[1:]):
        out[phase_name(phases.at((a + b) / 2))] += (b - a) / 1e3
    return dict(out)


def phase_name(annotation: Optional[str]) -> str:
    if annotation is None:
        return "outside a step"
    if annotation == STEP:
        return REST
    return FORWARD_OTHER if annotation == PREFIX + "forward" else annotation[len(PREFIX):]


def analyse(events: Sequence[dict], top: int = 12) -> dict:
    """Busy time, per-phase host and GPU time, and idle time by phase and operator, per step.

    Phases are ``west:`` user annotations; the window is from the first ``west:step`` start to
    the last one's end. GPU work (kernels, copies, memsets) is matched to the host launch of
    the same ``correlation`` id."""
    ann = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(PREFIX)]
    steps = [e for e in ann if e["name"] == STEP]
    if not steps:
        raise ValueError(f"the trace has no {STEP!r} ranges: nothing to analyse")
    n = len(steps)
    lo = min(e["ts"] for e in steps)
    hi = max(e["ts"] + e["dur"] for e in steps)
    window = hi - lo
    phases = Innermost((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ann)

    host_ms = exclusive_ms(ann, phases)

    gpu = [e for e in events if e.get("cat") in GPU_CATS and e["ts"] < hi and e["ts"] + e["dur"] > lo]
    result = {"steps": n, "window_ms": window / 1e3, "step_ms": window / 1e3 / n,
              "host_ms_per_step": {k: v / n for k, v in host_ms.items()},
              "gpu_ops_per_step": len(gpu) / n, "gpu_busy_pct": None, "phases": {}, "idle_by_op": []}
    if not gpu:
        return result

    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    ops_by_tid: dict = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops_by_tid[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    ops = {tid: Innermost(r) for tid, r in ops_by_tid.items()}

    def launched(e: dict) -> tuple[str, str]:
        """(phase, aten op) of the host launch behind GPU event ``e``."""
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is None:
            return "unattributed", "unattributed"
        op = ops[launch["tid"]].at(launch["ts"]) if launch.get("tid") in ops else None
        return phase_name(phases.at(launch["ts"])), op or launch["name"]

    per_phase: dict[str, dict] = defaultdict(lambda: {"gpu_ops": 0, "gpu_ms": 0.0, "idle_ms": 0.0})
    for e in gpu:
        p = per_phase[launched(e)[0]]
        p["gpu_ops"] += 1
        p["gpu_ms"] += e["dur"] / 1e3
    busy = clip(union((e["ts"], e["ts"] + e["dur"]) for e in gpu), lo, hi)
    busy_us = sum(e - s for s, e in busy)

    # Each gap (and the idle start of the window) is charged to the GPU event that ended it.
    first_at = sorted(gpu, key=lambda e: e["ts"])
    starts = [e["ts"] for e in first_at]
    idle_op: dict[str, list] = defaultdict(lambda: [0.0, 0])
    edges = [lo] + [e for _, e in busy]
    for gap_start, nxt in zip(edges, [s for s, _ in busy] + [hi]):
        if nxt <= gap_start:
            continue
        i = bisect.bisect_left(starts, nxt)
        if i >= len(first_at):     # idle tail after the last GPU event: the host's end of step
            phase, op = REST, "end of step (host)"
        else:
            phase, op = launched(first_at[i])
        per_phase[phase]["idle_ms"] += (nxt - gap_start) / 1e3
        idle_op[op][0] += (nxt - gap_start) / 1e3
        idle_op[op][1] += 1
    result["gpu_busy_pct"] = 100.0 * busy_us / window
    result["phases"] = {k: {"gpu_ops_per_step": v["gpu_ops"] / n, "gpu_ms_per_step": v["gpu_ms"] / n,
                            "idle_ms_per_step": v["idle_ms"] / n} for k, v in per_phase.items()}
    ranked = sorted(idle_op.items(), key=lambda kv: -kv[1][0])[:top]
    result["idle_by_op"] = [{"op": k, "idle_ms_per_step": ms / n, "gaps_per_step": c / n} for k, (ms, c) in ranked]
    return result


GAP_BUCKETS_US = (10.0, 100.0, 1000.0)   # idle gaps < 10 us, < 100 us, < 1 ms, longer
LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def bucket_name(i: int) -> str:
    edges = ["0"] + [f"{b:g} us" for b in GAP_BUCKETS_US]
    return f"{edges[i]} - {edges[i + 1]}" if i < len(GAP_BUCKETS_US) else f">= {edges[-1]}"


def kernel_timeline(events: Sequence[dict], steps: int, top: int = 8) -> dict:
    """Busy time and idle gaps of a kernels-only trace (``ProfilerActivity.CUDA`` alone: the GPU's
    kernels, copies and memsets, and the CUDA runtime calls that launched them, without the CPU
    operators whose recording slows the host that is measured).

    The window runs from the first GPU event to the last, over ``steps`` steps. Each idle gap is
    charged by the launch of the event that ended it: *host late* when that launch call began
    after the GPU had gone idle (the host, not the GPU, was behind), *queued* when it was already
    issued (a dependency or the device's own latency). Gaps are also counted by length, runtime
    calls other than launches by the idle time they overlap (a ``cudaFree``, ``cudaMalloc`` or
    synchronisation inside gaps is a stall, not launch overhead), and the longest gaps name the
    kernels around them."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        raise ValueError("the trace has no GPU events (kernels, copies, memsets): nothing to analyse")
    n = max(int(steps), 1)
    runtime = [e for e in events if e.get("cat") in LAUNCH_CATS]
    launches = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    lo, hi = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    busy = union((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    starts = [e["ts"] for e in gpu]
    idle = {"host late": 0.0, "queued": 0.0, "unattributed": 0.0}
    buckets = [[0, 0.0] for _ in range(len(GAP_BUCKETS_US) + 1)]
    gaps = []
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
        length = gap_end - gap_start
        nxt = gpu[bisect.bisect_left(starts, gap_end)]
        launch = launches.get(nxt.get("args", {}).get("correlation"))
        kind = "unattributed" if launch is None else "host late" if launch["ts"] >= gap_start else "queued"
        idle[kind] += length
        b = buckets[bisect.bisect_right(GAP_BUCKETS_US, length)]
        b[0], b[1] = b[0] + 1, b[1] + length
        before = gpu[bisect.bisect_left(starts, gap_start) - 1] if starts[0] < gap_start else None
        gaps.append((length, gap_start, gap_end, kind, before, nxt))
    in_gaps: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])   # calls, call us, idle us they overlap
    gap_ends = [g[2] for g in gaps]
    for e in runtime:
        name = e.get("name", "?")
        if name in LAUNCH_NAMES:
            continue
        c = in_gaps[name]
        c[0] += 1
        c[1] += e["dur"]
        i, end = bisect.bisect_right(gap_ends, e["ts"]), e["ts"] + e["dur"]
        while i < len(gaps) and gaps[i][1] < end:   # the gaps (sorted, disjoint) this call overlaps
            c[2] += min(end, gaps[i][2]) - max(e["ts"], gaps[i][1])
            i += 1
    window = hi - lo
    busy_us = sum(e - s for s, e in busy)
    calls = sorted(in_gaps.items(), key=lambda kv: (-kv[1][2], -kv[1][1]))[:top]
    return {
        "steps": n, "window_ms": window / 1e3, "step_ms": window / 1e3 / n,
        "gpu_busy_pct": 100.0 * busy_us / window if window > 0 else 100.0,
        "gpu_ops_per_step": len(gpu) / n, "gaps_per_step": len(gaps) / n,
        "launch_calls_per_step": sum(1 for e in runtime if e.get("name") in LAUNCH_NAMES) / n,
        "idle_ms_per_step": {k: v / 1e3 / n for k, v in idle.items()},
        "gaps_by_length": [{"length": bucket_name(i), "gaps_per_step": c / n, "idle_ms_per_step": us / 1e3 / n}
                           for i, (c, us) in enumerate(buckets)],
        "runtime_calls": [{"call": k, "calls_per_step": c / n, "ms_per_step": ms / 1e3 / n,
                           "idle_overlap_ms_per_step": ov / 1e3 / n} for k, (c, ms, ov) in calls],
        "by_category": by_category(gpu, n),
        "longest_gaps": [{"idle_us": length, "kind": kind, "after": (before or {}).get("name", "(start)")[:80],
                          "before": nxt.get("name", "?")[:80]}
                         for length, _, _, kind, before, nxt in sorted(gaps, key=lambda g: -g[0])[:top]],
    }


def timeline_table(res: dict) -> str:
    """Markdown for :func:`kernel_timeline`: the idle time by cause and by gap length, the runtime
    calls that overlap it, and the longest gaps."""
    idle = res["idle_ms_per_step"]
    lines = [f"{res['steps']} steps, {res['step_ms']:.1f} ms per step (first to last GPU event), GPU busy "
             f"{res['gpu_busy_pct']:.1f} %, {res['gpu_ops_per_step']:,.0f} GPU ops and "
             f"{res['launch_calls_per_step']:,.0f} launch calls per step; idle per step: host late "
             f"{idle['host late']:.1f} ms, queued {idle['queued']:.1f} ms"
             + (f", unattributed {idle['unattributed']:.1f} ms" if idle["unattributed"] else ""),
             "", "| idle gap length | gaps per step | idle ms per step |", "|---|---|---|"]
    lines += [f"| {g['length']} | {g['gaps_per_step']:,.1f} | {g['idle_ms_per_step']:.2f} |" for g in res["gaps_by_length"]]
    if res["runtime_calls"]:
        lines += ["", "| runtime call (not a launch) | calls per step | ms per step | idle ms it overlaps |",
                  "|---|---|---|---|"]
        lines += [f"| {c['call']} | {c['calls_per_step']:,.1f} | {c['ms_per_step']:.2f} | "
                  f"{c['idle_overlap_ms_per_step']:.2f} |" for c in res["runtime_calls"]]
    if res.get("by_category"):
        lines += ["", category_table(res["by_category"])]
    lines += ["", "| longest gaps (us) | kind | after kernel | before kernel |", "|---|---|---|---|"]
    lines += [f"| {g['idle_us']:.0f} | {g['kind']} | {g['after']} | {g['before']} |" for g in res["longest_gaps"]]
    return "\n".join(lines)


PHASE_ORDER = ("forward/encoder", "forward/projector", "forward/llm", FORWARD_OTHER, REST, "optimizer",
               phase_name(None))


def table(res: dict) -> str:
    """Markdown: per phase, host wall time, GPU ops, GPU time and the GPU's idle time it caused."""
    busy = res["gpu_busy_pct"]
    head = (f"{res['steps']} steps, {res['step_ms']:.1f} ms per step, GPU busy "
            f"{'n/a (no GPU events)' if busy is None else f'{busy:.0f} %'}, "
            f"{res['gpu_ops_per_step']:,.0f} GPU ops per step")
    lines = [head, "", "| phase | host ms per step (innermost) | GPU ops | GPU ms | GPU idle ms (gaps it ended) |",
             "|---|---|---|---|---|"]
    names = [p for p in PHASE_ORDER if p in res["host_ms_per_step"] or p in res["phases"]]
    names += sorted((set(res["phases"]) | set(res["host_ms_per_step"])) - set(names))
    for p in names:
        g = res["phases"].get(p, {})
        host = res["host_ms_per_step"].get(p)
        lines.append(f"| {p} | {'-' if host is None else f'{host:.1f}'} | {g.get('gpu_ops_per_step', 0):,.0f} | "
                     f"{g.get('gpu_ms_per_step', 0.0):.1f} | {g.get('idle_ms_per_step', 0.0):.1f} |")
    if res["idle_by_op"]:
        lines += ["", "| host operator before an idle gap | idle ms per step | gaps per step |", "|---|---|---|"]
        lines += [f"| {r['op']} | {r['idle_ms_per_step']:.2f} | {r['gaps_per_step']:.1f} |" for r in res["idle_by_op"]]
    return "\n".join(lines)
