#!/usr/bin/env python3
"""Benchmark west.data.packing against lightbinpack (when installed) on two workloads.

Not a test: prints a markdown table and writes JSON. For every workload and N each
packer is called once to warm up (numba loads its cached kernels), then timed in
``--rounds`` interleaved rounds (every packer once per round, so a busy machine
slows all of them alike); the table gives the median. Columns:

* time, and time over lightbinpack's counterpart in the same run (west dp plans
  vs ``ogbfd``, west single bins vs ``obfd``); both sides start from a numpy
  array and return nested Python lists (lightbinpack's ``tolist`` is counted);
* bins, the lower bound ceil(Σ/capacity), fill = Σ/(bins·capacity);
* exactly-once: every item in exactly one bin and no bin over capacity (``no``
  is a failed plan, not a slow one);
* every time includes one full garbage collection after the call (``idle_gc_s``
  in the JSON is that collection with nothing to free);
* for dp_size=8 plans the per-step max/min of the ranks' Σlen and Σlen² (median
  and p99 over steps) and the number of empty bins.

Compilation is reported apart from the timings: ``jit_first_s`` is this process's
first call (numba's on-disk cache, or a compile when the cache is cold); with
``--cold_jit`` a subprocess with an empty ``NUMBA_CACHE_DIR`` times a true compile.
``--merge`` prints one table from several JSON files, the median of each cell's
time over the runs (the machine is shared: run it three times).

    python tools/bench_packing.py --sizes 1000000 --out exp/bench_packing_1.json
    python tools/bench_packing.py --merge exp/bench_packing_{1,2,3}.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
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
# west packer -> the lightbinpack packer it is compared with
REFERENCE = {"west nf": "lightbinpack obfd", "west ffd": "lightbinpack obfd", "west bfd": "lightbinpack obfd",
             f"west dp={DP} square": f"lightbinpack ogbfd dp={DP}",
             f"west dp={DP} linear": f"lightbinpack ogbfd dp={DP}"}


def packers() -> dict:
    """name -> (callable(lengths ndarray, capacity), dp_size)."""
    out = {
        "west nf": (lambda x, c: pack(x, c, algorithm="nf"), 1),
        "west ffd": (lambda x, c: pack(x, c, algorithm="ffd"), 1),
        "west bfd": (lambda x, c: pack(x, c, algorithm="bfd"), 1),
        f"west dp={DP} square": (lambda x, c: pack(x, c, dp_size=DP, cost="square"), DP),
        f"west dp={DP} linear": (lambda x, c: pack(x, c, dp_size=DP, cost="linear"), DP),
    }
    try:
        import lightbinpack
    except ImportError:
        print("lightbinpack is not installed (pip install -e '.[bench]' in west's checkout): west only", file=sys.stderr)
        return out
    out["lightbinpack obfd"] = (lambda x, c: lightbinpack.obfd(x.tolist(), c), 1)
    out[f"lightbinpack ogbfd dp={DP}"] = (lambda x, c: lightbinpack.ogbfd(x.tolist(), c, DP), DP)
    return out


def exactly_once(bins: list, lengths: np.ndarray, capacity: int) -> bool:
    """Every item in exactly one bin, no bin over capacity."""
    sizes = [len(b) for b in bins]
    flat = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=sum(sizes))
    if flat.shape[0] != lengths.shape[0] or (np.bincount(flat, minlength=lengths.shape[0]) != 1).any():
        return False
    fill = np.bincount(np.repeat(np.arange(len(sizes)), sizes), weights=lengths[flat], minlength=len(sizes))
    return bool((fill <= capacity).all())


def balance(steps: list, lengths: np.ndarray) -> dict:
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


def timed(fn, lengths: np.ndarray, capacity: int) -> float:
    """One call plus a full garbage collection, from a collected heap: each packer pays
    for the Python lists it returns (made with the collector paused or not) once, and
    nothing for other packers' objects."""
    gc.collect()
    t0 = time.perf_counter()
    result = fn(lengths, capacity)
    gc.collect()
    seconds = time.perf_counter() - t0
    del result
    return seconds


def run(sizes: list[int], rounds: int) -> list[dict]:
    rows = []
    fns = packers()
    for wname, (make, capacity) in WORKLOADS.items():
        for n in sizes:
            lengths = make(n)
            lower = -(-int(lengths.sum()) // capacity)
            stats = {}
            for name, (fn, dp) in fns.items():     # warm-up: the plan each packer makes
                result = fn(lengths, capacity)
                bins = [b for s in result for b in s] if dp > 1 else result
                stats[name] = dict(bins=len(bins), lower_bound=lower,
                                   fill=float(lengths.sum()) / (len(bins) * capacity),
                                   exactly_once=exactly_once(bins, lengths, capacity))
                if dp > 1:
                    stats[name].update(balance(result, lengths))
                del result, bins
            times = {name: [] for name in fns}
            for _ in range(rounds):
                for name, (fn, _) in fns.items():
                    times[name].append(timed(fn, lengths, capacity))
            for name, (fn, dp) in fns.items():
                row = dict(workload=wname, n=n, capacity=capacity, packer=name, dp_size=dp,
                           seconds=statistics.median(times[name]), times=times[name], **stats[name])
                rows.append(row)
                print(f"  {wname} N={n} {name}: {row['seconds']*1e3:.1f} ms, {row['bins']} bins", file=sys.stderr)
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Add ``vs_reference``: time over the matching lightbinpack row of the same run."""
    ref = {(r["workload"], r["n"], r["packer"]): r["seconds"] for r in rows}
    for r in rows:
        other = ref.get((r["workload"], r["n"], REFERENCE.get(r["packer"], "")))
        r["vs_reference"] = r["seconds"] / other if other else None
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| workload | N | packer | time (ms) | vs lightbinpack | bins | lower bound | fill | exactly once | "
            "Σlen max/min med / p99 | Σlen² max/min med / p99 | empty bins |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        dp = r["dp_size"] > 1
        bal = lambda k: f"{r[k + '_ratio_median']:.4f} / {r[k + '_ratio_p99']:.4f}" if dp else ""
        vs = f"{r['vs_reference']:.2f}×" if r.get("vs_reference") else ""
        lines.append(f"| {r['workload']} | {r['n']:,} | {r['packer']} | {r['seconds']*1e3:.1f} | {vs} | "
                     f"{r['bins']:,} | {r['lower_bound']:,} | {r['fill']*100:.3f}% | "
                     f"{'yes' if r['exactly_once'] else 'NO'} | {bal('len')} | {bal('len2')} | "
                     f"{r['empty_bins'] if dp else ''} |")
    return "\n".join(lines)


def first_call_seconds() -> float:
    """The first dp plan of this process: numba loading (or compiling) its kernels."""
    t0 = time.perf_counter()
    pack(np.array([3, 4, 5, 9]), 10, dp_size=2, cost="square")
    pack(np.array([3, 4, 5, 9]), 10, algorithm="ffd")
    pack(np.array([3, 4, 5, 9]), 10, algorithm="nf", dp_size=2)
    return time.perf_counter() - t0


def cold_jit_seconds() -> float:
    """First call in a fresh process whose numba cache is empty: a true compile."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, __file__, "--first_call_only"], env=env, check=True,
                             capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def merge(paths: list[str]) -> tuple[dict, list[dict]]:
    """One set of rows from several runs: every cell's time is the median over runs,
    each ratio the median of the per-run ratios."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    rows = []
    for i, row in enumerate(runs[0]["rows"]):
        same = [run["rows"][i] for run in runs]
        assert all((r["workload"], r["n"], r["packer"]) == (row["workload"], row["n"], row["packer"]) for r in same)
        row = dict(row, seconds=statistics.median(r["seconds"] for r in same),
                   run_seconds=[r["seconds"] for r in same])
        ratios = [r["vs_reference"] for r in same if r.get("vs_reference")]
        row["vs_reference"] = statistics.median(ratios) if ratios else None
        rows.append(row)
    meta = dict(runs[0]["meta"], merged_from=paths, jit_first_s=[r["meta"]["jit_first_s"] for r in runs])
    return meta, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 120_000, 1_000_000])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds per packer")
    ap.add_argument("--cold_jit", action="store_true", help="also time a compile with an empty numba cache")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="print one table from earlier runs' JSON")
    ap.add_argument("--out", default="exp/bench_packing.json")
    ap.add_argument("--first_call_only", action="store_true", help=argparse.SUPPRESS)  # cold_jit_seconds' child
    args = ap.parse_args()
    if args.first_call_only:
        print(first_call_seconds())
        return
    if args.merge:
        meta, rows = merge(args.merge)
    else:
        meta = dict(machine=platform.machine(), cpus=os.cpu_count(), python=platform.python_version(),
                    date=time.strftime("%Y-%m-%d %H:%M:%S"), jit_first_s=first_call_seconds(),
                    idle_gc_s=timed(lambda x, c: None, np.zeros(1), 1))
        if args.cold_jit:
            meta["jit_cold_s"] = cold_jit_seconds()
        rows = with_ratios(run(args.sizes, args.rounds))
        meta["load_avg_after"] = os.getloadavg()
    print(markdown(rows))
    print("\nfirst call (numba cache load or compile, not in the times): "
          + ", ".join(f"{k} = {v}" for k, v in meta.items() if k.startswith("jit_")))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
