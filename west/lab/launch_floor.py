"""The host's cost per dispatched operator on this machine, apart from any model: the floor a
host-paced step cannot go under.

A step paced by the host takes about (operators it dispatches) × (host time per operator), and
the second factor is the machine's: its CPU, its driver, torch's build. The earlier H200 runs
gave about 37 µs of host time per launched kernel over the whole step, and 52 µs per operator
the fused RMSNorm removed. Whether that is this floor, or the floor plus something else (waits,
the loader, the GIL), decides what can still help: only fewer operators (fusion, compiling,
graphs), or something to find first. Each workload below runs ``calls`` times; the host's time
is the loop's wall time without a synchronisation, the device's the same loop drained after it:

* ``launch``: an in-place add on one element, no autograd (one kernel launch per operator);
* ``allocate``: the same out of place (one allocation from the caching allocator per operator);
* ``autograd``: a chain of small linear layers and GELUs with trainable weights, forward and
  backward (autograd records and replays each operator's node);
* ``autocast``: that chain under bf16 autocast with float32 weights (a cast per weight and
  input, and the casts' gradients), as the trainable encoder runs.

Operators are counted with ``west.bench.op_counter.OpCounter`` (views apart, as they launch
nothing); the time per operator divides by the non-view count.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from west.bench.op_counter import OpCounter
from west.bench.timing import host_and_device_ms

WORKLOADS = ("launch", "allocate", "autograd", "autocast")


def _workload(name: str, device: torch.device, ops: int, width: int) -> Callable[[], None]:
    """One call of workload ``name`` with about ``ops`` operators."""
    x = torch.zeros(1, device=device)
    if name == "launch":
        def run() -> None:
            for _ in range(ops):
                x.add_(1.0)
        return run
    if name == "allocate":
        def run() -> None:
            y = x
            for _ in range(ops):
                y = y + 1.0
        return run
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    layers = max(1, ops // 12)   # linear + gelu forward, about 12 operators with their backward
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(width, width, generator=gen) / width ** 0.5).to(device).requires_grad_(True)
               for _ in range(layers)]
    inp = torch.randn(64, width, generator=gen).to(device)
    cast = name == "autocast"

    def run() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cast):
            h = inp
            for w in weights:
                h = F.gelu(F.linear(h, w))
            loss = h.float().square().mean()
        loss.backward()
        for w in weights:
            w.grad = None
    return run


def count_ops(fn: Callable[[], None]) -> tuple[int, int]:
    """(non-view operators, view operators) one call of ``fn`` dispatches."""
    counter = OpCounter()
    with counter:
        fn()
    tot = counter.totals()
    return tot["total"] - tot["views"], tot["views"]


def measure(name: str, device: torch.device, ops: int = 2000, width: int = 64, repeats: int = 5,
            warmup: int = 2) -> dict:
    """Host and device time per operator of one workload: medians over ``repeats`` calls."""
    device = torch.device(device)
    fn = _workload(name, device, ops, width)
    host_ms, wall_ms = host_and_device_ms(fn, device, repeats, warmup)
    launched, views = count_ops(fn)   # after the warm-up: lazily made state is not a per-call cost
    return {"workload": name, "operators": launched, "views": views,
            "host_us_per_op": 1e3 * host_ms / max(launched, 1), "wall_us_per_op": 1e3 * wall_ms / max(launched, 1),
            "host_ms_per_call": host_ms, "wall_ms_per_call": wall_ms}


def floor_table(rows: list[dict]) -> str:
    """Markdown: one row per workload."""
    lines = ["| workload | operators per call (views) | host µs per operator | with the device drained |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['operators']:,} ({r['views']:,}) | {r['host_us_per_op']:.1f} "
                     f"| {r['wall_us_per_op']:.1f} |")
    return "\n".join(lines)
