#!/usr/bin/env python3
"""Benchmark west.data.packing (and lightbinpack, when installed) on two workloads.

Not a test: prints a markdown table and writes JSON. For every N and workload it
reports wall time (median of --repeats runs after one warm-up), bins, the lower
bound ceil(Σ/capacity), fill = Σ/(bins·capacity), and for dp_size=8 plans the
per-step max/min ratio of Σlen and Σlen² (median and p99).

    python tools/bench_packing.py [--sizes 10000 120000 1000000] [--out exp/bench_packing.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from west.data.packing import pack
from west.data.workloads import aishell_like_tokens, uniform_tokens

WORKLOADS = {
    "aishell-like": (lambda n: aishell_like_tokens(n, seed=0), 8192),
    "uniform[1000,20000)": (lambda n: uniform_tokens(n, seed=0), 50000),
}
DP = 8


def packers():
    """name -> (callable(lengths ndarray, capacity), dp_size)."""
    out = {
        "west nf": (lambda x, c: pack(x, c, algorithm="nf"), 1),
        "west ffd": (lambda x, c: pack(x, c, algorithm="ffd"), 1),
        "west bfd": (lambda x, c: pack(x, c, algorithm="bfd"), 1),
        f"west bfd dp={DP} square": (lambda x, c: pack(x, c, dp_size=DP, cost="square"), DP),
        f"west bfd dp={DP} linear": (lambda x, c: pack(x, c, dp_size=DP, cost="linear"), DP),
    }
    try:
        import lightbinpack
    except ImportError:
        return out
    # lightbinpack takes a Python list; converting is part of its cost, as ours is.
    out["lightbinpack obfd"] = (lambda x, c: lightbinpack.obfd(x.tolist(), c), 1)
    out[f"lightbinpack ogbfd dp={DP}"] = (lambda x, c: lightbinpack.ogbfd(x.tolist(), c, DP), DP)
    return out


def balance(steps, lengths: np.ndarray) -> dict:
    """Per-step max/min of Σlen and Σlen² over the bins of each step."""
    sizes = [len(b) for s in steps for b in s]
    flat = np.fromiter((i for s in steps for b in s for i in b), dtype=np.int64, count=sum(sizes))
    bin_of = np.repeat(np.arange(len(sizes)), sizes)
    lin = np.bincount(bin_of, weights=lengths[flat].astype(float), minlength=len(sizes))
    sq = np.bincount(bin_of, weights=lengths[flat].astype(float) ** 2, minlength=len(sizes))
    dp = len(steps[0])
    out = {}
    for name, work in (("len", lin), ("len2", sq)):
        w = work.reshape(-1, dp)
        ratio = w.max(1) / np.maximum(w.min(1), 1e-9)
        out[f"{name}_ratio_median"] = float(np.median(ratio))
        out[f"{name}_ratio_p99"] = float(np.percentile(ratio, 99))
    out["empty_bins"] = int(sum(1 for s in steps for b in s if not b))
    return out


def run(sizes, repeats: int) -> list[dict]:
    rows = []
    fns = packers()
    for wname, (make, capacity) in WORKLOADS.items():
        for n in sizes:
            lengths = make(n)
            lower = -(-int(lengths.sum()) // capacity)
            for pname, (fn, dp) in fns.items():
                result = fn(lengths, capacity)  # warm-up (and JIT load)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    result = fn(lengths, capacity)
                    times.append(time.perf_counter() - t0)
                n_bins = sum(len(s) for s in result) if dp > 1 else len(result)
                row = dict(workload=wname, n=n, capacity=capacity, packer=pname, dp_size=dp,
                           seconds=statistics.median(times), bins=n_bins, lower_bound=lower,
                           fill=float(lengths.sum()) / (n_bins * capacity))
                if dp > 1:
                    row.update(balance(result, lengths))
                rows.append(row)
                print(f"  {wname} N={n} {pname}: {row['seconds']*1e3:.1f} ms, {n_bins} bins", file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| workload | N | packer | time (ms) | bins | lower bound | fill | "
            "Σlen max/min med / p99 | Σlen² max/min med / p99 |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        bal = lambda k: (f"{r[k + '_ratio_median']:.4f} / {r[k + '_ratio_p99']:.4f}" if r["dp_size"] > 1 else "")
        lines.append(f"| {r['workload']} | {r['n']:,} | {r['packer']} | {r['seconds']*1e3:.1f} | {r['bins']:,} | "
                     f"{r['lower_bound']:,} | {r['fill']*100:.3f}% | {bal('len')} | {bal('len2')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 120_000, 1_000_000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="exp/bench_packing.json")
    args = ap.parse_args()
    rows = run(args.sizes, args.repeats)
    table = markdown(rows)
    print(table)
    meta = dict(machine=platform.machine(), cpus=os.cpu_count(), python=platform.python_version(),
                date=time.strftime("%Y-%m-%d %H:%M:%S"), load_avg=os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
