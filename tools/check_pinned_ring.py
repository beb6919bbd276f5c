"""``train.pinned_ring_mib`` on a GPU: the ring's copies arrive intact, and what each way of copying
a small host tensor costs the launching thread.

    python tools/check_pinned_ring.py [--out ring.json]

1. Intact: thousands of random tensors through a small ring while the GPU runs tens of
   milliseconds behind (``torch.cuda._sleep``), so the ring wraps and must wait for its copies;
   every result is compared with its source. Any mismatch fails the tool (exit 1).
2. Cost: host µs per copy of a step's typical index sizes (1 KiB to 512 KiB), the GPU behind,
   for three ways: ``pin_memory()`` per copy (west's default), the ring, and a plain
   ``non_blocking`` copy of pageable memory (no pinning; the driver stages it); and, for scale, a
   small kernel launch with no copy. Alone, and with a thread pinning 16-24 MiB batches beside the
   launching thread, as the loader's pin thread does: if that slows the launches too, the pin
   thread costs west-train's host-paced phases time (the 1.27x of its step over the benchmark's).

The ring's logic is tested on the CPU against a model of a lagging device
(tests/test_pinned_ring.py); this needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from west.pinned_ring import PinnedRing
from west.ranks import cuda_allocator_defaults

SIZES = [2**k for k in range(10, 20)]        # 1 KiB .. 512 KiB
WAYS = ("pin each", "ring", "pageable", "launch only")


def lag(device: torch.device, ms: float) -> None:
    """Queue about ``ms`` of GPU time that does nothing, so later copies wait behind it."""
    torch.cuda._sleep(int(ms * _cycles_per_ms(device)))


_calibrated: dict = {}


def _cycles_per_ms(device: torch.device) -> float:
    if device not in _calibrated:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _calibrated[device] = 10_000_000 / start.elapsed_time(end)
    return _calibrated[device]


def race_check(device: torch.device, copies: int, ring_kib: int, seed: int = 0) -> dict:
    """Random int64 / int32 / bool / float tensors through a ring of ``ring_kib`` KiB, the GPU put
    behind every 50 copies; mismatches between each result and its source."""
    g = torch.Generator().manual_seed(seed)
    ring = PinnedRing(ring_kib * 1024, device)
    sent, got = [], []
    for i in range(copies):
        if i % 50 == 0:
            lag(device, 20)
        n = int(torch.randint(0, ring_kib * 1024 // 16, (), generator=g))
        kind = i % 4
        t = (torch.randint(-2**40, 2**40, (n,), generator=g) if kind == 0 else
             torch.randint(-2**30, 2**30, (n,), generator=g, dtype=torch.int32) if kind == 1 else
             torch.rand(n, generator=g) > 0.5 if kind == 2 else torch.randn(n, generator=g))
        sent.append(t.clone())
        got.append(ring.to_device(t))
        t.zero_()                       # the source may change once the call returns
    torch.cuda.synchronize(device)
    bad = sum(not torch.equal(a, b.cpu()) for a, b in zip(sent, got))
    return dict(copies=ring.copies, waits=ring.waits, wraps=ring.wraps, mismatched=bad, ring_kib=ring_kib)


def copy_cost(device: torch.device, way: str, rounds: int, contend: bool, ring: PinnedRing) -> float:
    """Median host µs per call over ``rounds`` rounds of one call per size in SIZES, the GPU 30 ms
    behind at each round's start; with ``contend`` a thread pins 16-24 MiB batches meanwhile."""
    scratch = torch.zeros(16, device=device)
    copy = {"pin each": lambda t: t.pin_memory().to(device, non_blocking=True),
            "ring": ring.to_device,
            "pageable": lambda t: t.to(device, non_blocking=True),
            "launch only": lambda t: scratch.add_(1)}[way]
    stop = threading.Event()

    def pinning() -> None:
        k = 0
        while not stop.is_set():
            torch.empty((4 + k % 3) * 2**20, dtype=torch.float32).pin_memory()   # 16-24 MiB, as a batch
            k += 1

    helper = threading.Thread(target=pinning, daemon=True) if contend else None
    if helper:
        helper.start()
    sources = [torch.arange(size // 8) for size in SIZES]
    per_copy = []
    try:
        for r in range(rounds + 2):
            torch.cuda.synchronize(device)
            lag(device, 30)
            t0 = time.perf_counter()
            for s in sources:
                copy(s)
            if r >= 2:                   # two warm-up rounds: the host allocator's first blocks
                per_copy.append((time.perf_counter() - t0) / len(sources) * 1e6)
    finally:
        stop.set()
        if helper:
            helper.join()
    torch.cuda.synchronize(device)
    return statistics.median(per_copy)


def cost_table(costs: dict) -> str:
    """Markdown: one row per way, host µs per call alone and beside a pinning thread."""
    lines = ["| way | host µs per call, alone | beside a pinning thread |", "|---|---|---|"]
    for way in WAYS:
        lines.append(f"| {way} | {costs[way]['alone']:.1f} | {costs[way]['contended']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--copies", type=int, default=3000)
    p.add_argument("--ring_kib", type=int, default=256, help="the race check's ring (small: it wraps often)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", help="JSON file for the results")
    a = p.parse_args(argv)
    cuda_allocator_defaults()   # the allocator west's commands run with (read when CUDA starts)
    device = torch.device(a.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print("check_pinned_ring: needs a CUDA device (the ring's logic is tested on the CPU by "
              "tests/test_pinned_ring.py)")
        return 2
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    race = race_check(device, a.copies, a.ring_kib)
    print(f"[check_pinned_ring] {race['copies']:,} copies through a {a.ring_kib} KiB ring, the GPU behind: "
          f"{race['mismatched']} mismatched, {race['waits']:,} waits, {race['wraps']:,} wraps")
    ring = PinnedRing(8 * 2**20, device)
    costs = {w: {"alone": copy_cost(device, w, a.rounds, False, ring),
                 "contended": copy_cost(device, w, a.rounds, True, ring)} for w in WAYS}
    print(f"\nhost time per copy of a small index tensor ({SIZES[0] // 1024}-{SIZES[-1] // 1024} KiB, "
          f"the GPU 30 ms behind), {torch.cuda.get_device_name(device)}, medians of {a.rounds} rounds\n")
    print(cost_table(costs))
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(device), "race": race,
                                           "costs_us": costs, "sizes": SIZES}, indent=1))
    return 1 if race["mismatched"] else 0


if __name__ == "__main__":
    sys.exit(main())
