#!/usr/bin/env python3
"""Benchmark epoch planning (``west.data.plan``) on synthetic AIShell-like lengths.

Not a test: nothing is asserted, it prints a markdown table and a one-line summary
and writes JSON. For every (mode, N) a fresh subprocess, pinned to one core with
one numba/OpenMP/BLAS thread (the planner is single-threaded Python + numba anyway):

1. imports ``west``, warms numba's JIT up on a tiny input (the first call, i.e.
   compilation or loading numba's on-disk cache, is reported separately as
   ``jit_first_s``), then builds the N lengths (outside the timing);
2. times what the loader does once per epoch: ``epoch_order`` + ``plan_epoch`` +
   ``plan.rank_batches(0)`` (median and min of ``--repeats``);
3. memory of the planning itself: (a) peak RSS minus the RSS after imports, JIT
   and lengths (``ru_maxrss``; the process's peak is reset through
   ``/proc/self/clear_refs`` right before planning, and free heap is trimmed, so
   the JIT and the length generation are not counted), (b) the tracemalloc peak of
   a second, traced planning run (numpy allocations are traced; numba's own
   allocations inside compiled code are not);
4. plan quality: steps, batches, fill (pack: Σlen / (batches × pack_tokens);
   static/dynamic: real / padded tokens with every row padded to the longest of its
   batch), and per-step max/min of the ranks' Σlen (median and p99 over steps).

With ``--cold_jit`` one more subprocess per mode measures the first call with an
empty numba cache (``NUMBA_CACHE_DIR`` in a temporary directory): a true compile.
``--windows`` adds a window sweep for one mode and N (time vs fill).

    .venv/bin/python tools/bench_plan.py --sizes 1000000,10000000 --dp_size 8 --window 100000 \\
        --modes static,dynamic,pack --threads 1 --windows 25000,100000,400000 --json exp/bench_plan.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

SEED, EPOCH = 0, 0
THREAD_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


# --------------------------------------------------------------------------- worker
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux


def _reset_peak() -> bool:
    """Free what the heap holds, then reset the process's peak RSS to its current RSS."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _plan_once(n_records: int, lengths, policy, dp_size: int, window: int):
    import numpy as np

    from west.data.plan import epoch_order, plan_epoch

    order = epoch_order([np.arange(n_records)], None, SEED, EPOCH, shuffle=True)
    plan = plan_epoch(order, lengths, policy, world_size=dp_size, window=window,
                      rng=np.random.default_rng([SEED, EPOCH, 1]))
    kept = plan.rank_batches(0)
    return plan, kept


def _quality(plan, lengths, mode: str, budget: int) -> dict:
    import numpy as np

    sizes = np.diff(plan.bounds)
    per_item = lengths[plan.members]
    full = sizes > 0
    starts = plan.bounds[:-1][full]
    sums = np.zeros(sizes.shape[0], np.int64)
    longest = np.zeros(sizes.shape[0], np.int64)
    if starts.shape[0]:
        sums[full] = np.add.reduceat(per_item, starts)
        longest[full] = np.maximum.reduceat(per_item, starts)
    total = int(sums.sum())
    n_batches = int(sizes.shape[0])
    if mode == "pack":
        fill = total / max(1, n_batches * budget)
    else:
        fill = total / max(1, int((longest * sizes).sum()))
    n_steps = plan.n_steps
    per_step = sums[:n_steps * plan.world_size].reshape(n_steps, plan.world_size).astype(np.float64)
    ratio = per_step.max(1) / np.maximum(per_step.min(1), 1.0)
    return {
        "steps": int(n_steps), "batches": n_batches, "empty_batches": int((~full).sum()),
        "records_planned": int(sizes.sum()), "tokens": total, "fill": fill,
        "lower_bound_batches": -(-total // budget) if mode == "pack" else None,
        "step_len_ratio_median": float(np.median(ratio)) if n_steps else None,
        "step_len_ratio_p99": float(np.percentile(ratio, 99)) if n_steps else None,
    }


def worker(spec: dict) -> dict:
    if spec["threads"] == 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})   # one core
    t0 = time.perf_counter()
    import gc
    import tracemalloc

    import numpy as np

    from west.data.config import DataConfig
    from west.data.policies import make_policy
    from west.data.workloads import aishell_like_durations, aishell_like_tokens
    from west.shapes import SpeechShape
    out = dict(spec, import_s=time.perf_counter() - t0)

    conf = DataConfig(batch_type=spec["mode"], batch_size=spec["batch_size"],
                      max_tokens_in_batch=spec["max_tokens"], pack_tokens=spec["pack_tokens"])
    policy = make_policy(conf, 0, 1, SpeechShape())
    budget = {"static": spec["batch_size"], "dynamic": spec["max_tokens"], "pack": spec["pack_tokens"]}[spec["mode"]]

    tiny = aishell_like_tokens(4000, seed=1)
    t0 = time.perf_counter()
    _plan_once(tiny.shape[0], tiny, policy, spec["dp_size"], 1000)
    out["jit_first_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _plan_once(tiny.shape[0], tiny, policy, spec["dp_size"], 1000)
    out["tiny_warm_s"] = time.perf_counter() - t0
    n = spec["n"]
    if not n:
        return out

    lengths = aishell_like_tokens(n, seed=0)
    out["hours"] = float(aishell_like_durations(n, seed=0).sum()) / 3600   # the durations behind the lengths
    times = []
    plan = kept = None
    for rep in range(spec["repeats"]):
        plan = kept = None
        reset = _reset_peak()
        base = _rss_bytes()
        t0 = time.perf_counter()
        plan, kept = _plan_once(n, lengths, policy, spec["dp_size"], spec["window"])
        times.append(time.perf_counter() - t0)
        if rep == 0:
            out.update(rss_base_mib=base / 2**20, rss_peak_delta_mib=(_maxrss_bytes() - base) / 2**20,
                       rss_after_delta_mib=(_rss_bytes() - base) / 2**20, peak_reset=reset)
    out["plan_s"] = float(np.median(times))
    out["plan_s_all"] = times
    out["rank0_batches"] = len(kept)
    out.update(_quality(plan, lengths, spec["mode"], budget))

    plan = kept = None
    gc.collect()
    tracemalloc.start()
    plan, kept = _plan_once(n, lengths, policy, spec["dp_size"], spec["window"])
    out["tracemalloc_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return out


# --------------------------------------------------------------------------- parent
def run_worker(spec: dict, threads: int, cache_dir: str | None = None) -> dict:
    env = dict(os.environ)
    if threads:
        env.update({k: str(threads) for k in THREAD_VARS})
    if cache_dir:
        env["NUMBA_CACHE_DIR"] = cache_dir
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(spec)],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"worker failed for {spec}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ints(s: str) -> list[int]:
    return [int(float(x)) for x in s.split(",") if x]


def fmt_table(rows: list[dict]) -> str:
    head = ("| mode | N | window | plan time (s), median (min) | peak RSS Δ (MiB) | tracemalloc peak (MiB) | steps | batches "
            "| fill | step Σlen max/min med / p99 | JIT first call (s) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['n']:,} | {r['window']:,} | {r['plan_s']:.2f} ({min(r['plan_s_all']):.2f}) | {r['rss_peak_delta_mib']:.0f} "
            f"| {r['tracemalloc_peak_mib']:.0f} | {r['steps']:,} | {r['batches']:,} | {100 * r['fill']:.2f}% "
            f"| {r['step_len_ratio_median']:.4f} / {r['step_len_ratio_p99']:.4f} | {r['jit_first_s']:.2f} |")
    return "\n".join(lines)


def fmt_load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000000,10000000", help="comma-separated numbers of utterances")
    ap.add_argument("--dp_size", type=int, default=8)
    ap.add_argument("--window", type=int, default=100000, help="data.plan_window")
    ap.add_argument("--modes", default="static,dynamic,pack")
    ap.add_argument("--threads", type=int, default=1,
                    help="numba/OpenMP/BLAS threads of each worker; 1 also pins it to one core (0: leave as is)")
    ap.add_argument("--repeats", type=int, default=1, help="timed planning runs per (mode, N); median and min reported")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--max_tokens_in_batch", type=int, default=4096)
    ap.add_argument("--pack_tokens", type=int, default=8192)
    ap.add_argument("--windows", default="", help="window sweep, e.g. 25000,100000,400000 (empty: none)")
    ap.add_argument("--sweep_mode", default="pack")
    ap.add_argument("--sweep_size", type=int, default=1000000)
    ap.add_argument("--cold_jit", action="store_true", help="also time the first call with an empty numba cache")
    ap.add_argument("--json", default="", help="write all results here")
    ap.add_argument("--_worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        print(json.dumps(worker(json.loads(args._worker))))
        return

    base = dict(dp_size=args.dp_size, threads=args.threads, repeats=args.repeats, batch_size=args.batch_size,
                max_tokens=args.max_tokens_in_batch, pack_tokens=args.pack_tokens)
    jobs = [("main", m, n, args.window) for m in args.modes.split(",") for n in _ints(args.sizes)]
    done = {(m, n, w) for _, m, n, w in jobs}
    jobs += [("sweep", args.sweep_mode, args.sweep_size, w) for w in _ints(args.windows)
             if (args.sweep_mode, args.sweep_size, w) not in done]
    load_before = os.getloadavg()
    rows = []
    for kind, mode, n, window in jobs:
        r = run_worker(dict(base, mode=mode, n=n, window=window), args.threads)
        r["kind"] = kind
        rows.append(r)
        print(f"# {mode} N={n:,} window={window:,}: {r['plan_s']:.2f} s, peak RSS Δ {r['rss_peak_delta_mib']:.0f} MiB, "
              f"fill {100 * r['fill']:.2f}%", file=sys.stderr, flush=True)
    cold = {}
    if args.cold_jit:
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as d:
                cold[mode] = run_worker(dict(base, mode=mode, n=0, window=1000), args.threads, d)["jit_first_s"]

    load_after = os.getloadavg()
    main_rows = [r for r in rows if r["kind"] == "main"]
    print(fmt_table(main_rows))
    sweep = sorted((r for r in rows if r["mode"] == args.sweep_mode and r["n"] == args.sweep_size
                    and r["window"] in _ints(args.windows)), key=lambda r: r["window"])
    if sweep:
        print(f"\nWindow sweep ({args.sweep_mode}, N = {args.sweep_size:,}):\n")
        print(fmt_table(sweep))
    if cold:
        print("\nJIT first call with an empty numba cache (s): "
              + ", ".join(f"{m} {s:.1f}" for m, s in cold.items()))
    big = max(main_rows, key=lambda r: r["n"]) if main_rows else None
    if big:
        at = [r for r in main_rows if r["n"] == big["n"]]
        print(f"\nSummary: N = {big['n']:,}, dp_size {args.dp_size}, window {args.window:,}, one core: "
              + "; ".join(f"{r['mode']} {r['plan_s']:.1f} s / {r['rss_peak_delta_mib']:.0f} MiB peak RSS Δ / "
                          f"fill {100 * r['fill']:.1f}%" for r in at)
              + " (goal: < 10 s, < 1 GiB)")
    print(f"Load average (1, 5, 15 min) before {fmt_load(load_before)}, after {fmt_load(load_after)}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = dict(vars(args), load_before=load_before, load_after=load_after, python=platform.python_version(), machine=platform.machine(),
                    cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d"))
        meta.pop("_worker")
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "jit_cold_s": cold}, f, indent=1)


if __name__ == "__main__":
    main()
