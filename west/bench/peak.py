"""The machine's matrix-product peak, measured in the same run: the denominator of MFU.

A datasheet peak is not what this card or CPU gives today (clocks, power limits, a shared
machine), so the benchmark times one square matrix product itself: on CUDA bf16 at 8192³
(a size where cuBLAS reaches its peak), on a CPU in the run's own dtype at the largest
power-of-two size whose single product takes under ``cpu_target_s`` (a few seconds in all).
A few untimed warm-ups, then the mean of ``iters`` timed products.
"""
from __future__ import annotations

import time
from typing import Optional

import torch


def _time_mm(a: torch.Tensor, b: torch.Tensor, iters: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b)
    sync()
    return (time.perf_counter() - t0) / iters


def matmul_peak(device: torch.device, dtype: Optional[torch.dtype] = None, n: Optional[int] = None,
                warmup: int = 3, iters: int = 10, cpu_target_s: float = 0.15) -> dict:
    """{"tflops", "n", "dtype", "seconds_per_mm", "device"} of an n×n×n product ``torch.mm``."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    if n is None:
        if cuda:
            n = 8192
        else:   # grow until one product takes long enough to time, but stays short
            n = 256
            while n < 8192:
                x = torch.randn(n, n, dtype=dtype)
                if _time_mm(x, x, 1, sync) * 8 > cpu_target_s:
                    break
                n *= 2
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.mm(a, b)
    s = _time_mm(a, b, iters, sync)
    return {"tflops": 2 * n ** 3 / s / 1e12, "n": n, "dtype": str(dtype).replace("torch.", ""),
            "seconds_per_mm": s, "device": str(device), "iters": iters}


def run_peak(device: str, precision: str) -> dict:
    """The peak MFU is measured against: bf16 8192³ on CUDA; on a CPU the run's dtype (bf16 with
    ``precision: bf16``, else float32) at a size that finishes in a few seconds."""
    cpu_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return matmul_peak(torch.device(device), torch.bfloat16 if str(device).startswith("cuda") else cpu_dtype)
