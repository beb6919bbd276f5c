"""Which dtype a model's matrix products run in, under autocast or not: one rule for the loss,
the Conformer's choice of attention kernel, and the float32/float64 references."""
from __future__ import annotations

import torch


def autocast_on(device_type: str) -> bool:
    """Autocast is on for this device type (devices without autocast, e.g. meta: never). Code being
    compiled runs on a real device and skips the availability check: torch 2.11's dynamo (the GPU
    machines' torch) cannot trace it and would break every compiled graph that asks here."""
    if torch.compiler.is_compiling():
        return torch.is_autocast_enabled(device_type)
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_dtype(*tensors: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype products of ``tensors`` run in, or None where autocast leaves them
    alone (off for their device, or float64: never autocast)."""
    dev = tensors[0].device.type
    if autocast_on(dev) and all(t.dtype != torch.float64 for t in tensors):
        return torch.get_autocast_dtype(dev)
    return None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax / accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)
