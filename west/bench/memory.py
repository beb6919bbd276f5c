"""Memory budgets for the benchmark: sizes like ``24GiB``, the cap on a CUDA card, and a
tracker of live tensor bytes that turns a host-bytes budget into an out-of-memory error on a CPU.

On CUDA the budget is the caching allocator's own limit
(``torch.cuda.set_per_process_memory_fraction``): a real ``torch.OutOfMemoryError`` when
PyTorch would hold more than the budget (the CUDA context, a few hundred MiB, is outside it).

On a CPU nothing runs out of memory at a chosen size, so :class:`LiveTensorBytes` counts it:
a dispatch mode that adds the bytes of every new storage an operator returns and subtracts
them when that storage is freed (a weakref finalizer on the untyped storage), on top of a
baseline (the model's parameters and buffers, the batch). When the live total exceeds the
budget it raises ``torch.OutOfMemoryError`` (simulated). What it counts: tensor storages
returned by dispatched operators, at their size when returned, views and in-place results
not double counted. What it does not: temporaries a kernel allocates and frees inside
itself, the allocator's slack and fragmentation, the Python heap, and storages made before
the mode was entered other than the baseline's.
"""
from __future__ import annotations

import contextlib
import re
import weakref
from typing import Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, name: str = "--memory_budget") -> int:
    """Bytes from ``24GiB``, ``20GB``, ``512MiB``, ``1.5 GiB`` or a plain number of bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{name}: cannot read {text!r} as a size; write e.g. 24GiB, 20GB, 512MiB "
                         "(KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{name}: {text!r} is not a positive size")
    return n


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


class LiveTensorBytes(TorchDispatchMode):
    """Live tensor-storage bytes under the mode (module docstring); raises a simulated
    ``torch.OutOfMemoryError`` when ``baseline`` + live exceeds ``budget`` (None: only measure)."""

    def __init__(self, budget: Optional[int] = None, baseline: int = 0):
        super().__init__()
        self.budget, self.baseline = budget, baseline
        self.live = 0
        self.peak = baseline
        self._tracked: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        s = t.untyped_storage()
        key, nbytes = s.data_ptr(), s.nbytes()
        if nbytes == 0 or key in self._tracked:
            return
        self._tracked.add(key)
        self.live += nbytes
        weakref.finalize(s, self._release, key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        rets = func._schema.returns
        outs = out if len(rets) > 1 else (out,)
        for ret, o in zip(rets, outs):
            if ret.alias_info is not None:   # a view or an in-place/out= result: no new storage
                continue
            for t in tree_leaves(o):
                if isinstance(t, torch.Tensor):
                    self._track(t)
        total = self.baseline + self.live
        self.peak = max(self.peak, total)
        if self.budget is not None and total > self.budget:
            raise torch.OutOfMemoryError(
                f"simulated out of memory: live tensor bytes {fmt_bytes(total)} (after {func}) exceed the "
                f"host budget {fmt_bytes(self.budget)}")
        return out


_CAPS: dict[int, float] = {}   # CUDA device index -> the fraction cuda_budget set


def _cuda_index(device) -> int:
    """torch's cap wants an index; "cuda" means the current device."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_budget(device: torch.device, budget: Optional[int]) -> dict:
    """Cap this process's CUDA caching allocator at ``budget`` bytes (None: the card's size).
    Returns {"budget": bytes, "card": bytes, "fraction": f}."""
    device = torch.device("cuda", _cuda_index(device))
    card = torch.cuda.get_device_properties(device).total_memory
    if budget is not None and budget > card:
        raise ValueError(f"--memory_budget: {fmt_bytes(budget)} is more than the card's {fmt_bytes(card)} "
                         f"({torch.cuda.get_device_name(device)})")
    fraction = 1.0 if budget is None else budget / card
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    _CAPS[device.index] = fraction
    return {"budget": card if budget is None else budget, "card": card, "fraction": fraction}


@contextlib.contextmanager
def cap_lifted(device: torch.device) -> Iterator[None]:
    """Lift the cap of :func:`cuda_budget` for a bookkeeping pass, then set it again with the cache
    emptied, so the timed passes run under the budget as the search did. No-op elsewhere. FLOP and
    operator counts are not the step that was sized: the FLOP pass runs the LLM's packed attention
    as segment SDPA (what the counter can see), which needs more memory than the varlen kernel."""
    index = _cuda_index(device) if torch.device(device).type == "cuda" else None
    if index not in _CAPS:
        yield
        return
    torch.cuda.set_per_process_memory_fraction(1.0, index)
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(_CAPS[index], index)
