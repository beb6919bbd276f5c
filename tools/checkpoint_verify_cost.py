"""How long verifying a checkpoint's checksums takes next to loading it (docs/training.md).

Writes a checkpoint-shaped dir (model.safetensors of N float32 values, optimizer.pt with two
moments of the same size) with west's writers, records its checksums, then times, from a cold
page cache when ``--drop_caches`` (root) and warm otherwise: the CRC-32 of every byte
(west.checkpoint.checksums.verify) and loading both files (safetensors + torch.load).

    python tools/checkpoint_verify_cost.py --params 400e6 --dir /tmp/verify_cost [--drop_caches]
"""
from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from west.checkpoint import checksums, files


def drop_caches() -> None:
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed(fn, cold: bool) -> float:
    if cold:
        drop_caches()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=400e6, help="float32 values in the model")
    ap.add_argument("--dir", default="/tmp/verify_cost")
    ap.add_argument("--drop_caches", action="store_true", help="time from a cold page cache (needs root)")
    args = ap.parse_args()
    d = Path(args.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    n = int(args.params)
    files.save_tensors({"w": torch.randn(n)}, d / "model.safetensors")
    files.save_torch({"state": {0: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}}}, d / "optimizer.pt")
    checksums.record(d)
    size = sum(p.stat().st_size for p in d.iterdir())
    for cold in ([True, False] if args.drop_caches else [False]):
        checksums._verified.clear()
        verify = timed(lambda: checksums.verify(d), cold)
        load = timed(lambda: (files.load_tensors(d / "model.safetensors"),
                              torch.load(d / "optimizer.pt", weights_only=True)), cold)
        print(f"{'cold' if cold else 'warm'} cache, {size / 1e9:.2f} GB: verify {verify:.2f} s "
              f"({size / verify / 1e9:.2f} GB/s), load {load:.2f} s; verify/load {verify / load:.2f}")
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
