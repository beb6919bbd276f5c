"""Which dtype a model's matrix products run in, under autocast or not: one rule for the loss,
the Conformer's choice of attention kernel, and the float32/float64 references."""
from __future__ import annotations

import torch

# Asked once, at import: torch 2.11's dynamo (the GPU machines' torch) cannot trace
# torch.amp.is_autocast_available, and every compiled graph that asked would break there.
_HAS_AUTOCAST = {d: torch.amp.is_autocast_available(d) for d in ("cpu", "cuda", "xpu", "mps", "hpu", "meta")}


def autocast_on(device_type: str) -> bool:
    """Autocast is on for this device type (devices without autocast, e.g. meta: never)."""
    available = _HAS_AUTOCAST.get(device_type)
    if available is None:   # another device type: asked here (compiled code runs on the usual ones)
        available = torch.amp.is_autocast_available(device_type)
    return available and torch.is_autocast_enabled(device_type)


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
