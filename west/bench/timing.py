"""Median wall times of a callable on any device: the host's time (the call returns once its
kernels are queued) and the time with the device drained after it (its kernels have run)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def host_and_device_ms(fn: Callable[[], object], device: torch.device, repeats: int,
                       warmup: int = 3) -> tuple[float, float]:
    """(host ms, drained ms): medians over ``repeats`` calls of ``fn()`` after ``warmup`` untimed
    ones, the device synchronised before each call."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    host, drained = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        host.append(t1 - t0)
        drained.append(time.perf_counter() - t0)
    return statistics.median(host) * 1e3, statistics.median(drained) * 1e3


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median ms of ``fn()`` with its kernels run (:func:`host_and_device_ms`)."""
    return host_and_device_ms(fn, device, repeats, warmup)[1]
