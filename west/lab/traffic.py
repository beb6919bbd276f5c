"""Bytes and FLOPs of every dispatched operator: the memory and arithmetic floors of a step.

:class:`Traffic` sums, per aten operator, the bytes of the tensors it reads and writes, as if
nothing stayed in a cache: views, aliases and bare allocations move nothing and are left out;
an in-place operator writes its mutated argument once, and reads it too unless it only writes it
(``copy_``, ``fill_``, the random fills). :class:`Roofline` adds each call's FLOPs (torch's own
FLOP formulas) and its floor on a device of ``bandwidth`` bytes/s and ``peak`` FLOP/s: the longer of
moving its bytes and doing its FLOPs. Summed over a step, that is the time no kernel schedule can
beat with these operators, and where it goes says what fusing would buy.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

# no bytes move: a new view of the same storage, or memory handed out without writing it
FREE = frozenset({"_unsafe_view", "_reshape_alias", "alias", "lift_fresh", "empty", "empty_like",
                  "empty_strided", "new_empty", "new_empty_strided", "resize_"})
# in-place operators that overwrite their first argument without reading it
WRITE_ONLY = frozenset({"copy_", "fill_", "zero_", "bernoulli_", "uniform_", "normal_", "random_",
                        "exponential_", "geometric_", "log_normal_", "cauchy_"})


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def moved_bytes(name: str, args: tuple, kwargs: dict, out) -> int:
    """Bytes operator ``name`` reads and writes, given its arguments and result."""
    if name in FREE:
        return 0
    inputs = _tensors((args, kwargs))
    if not name.endswith("_"):
        return _nbytes(inputs) + _nbytes(_tensors(out))
    mutated = inputs[:1]   # aten's in-place overloads mutate self, their first argument
    read = inputs[1:] if name in WRITE_ONLY else inputs
    return _nbytes(read) + _nbytes(mutated)


class Traffic(TorchDispatchMode):
    """Bytes of the tensors each dispatched operator takes and returns (:func:`moved_bytes`),
    profiler markers and views left out: the device memory eager operators touch if nothing
    stays in a cache."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0
        self.by_op: Counter = Counter()      # operator name -> bytes
        self.calls: Counter = Counter()      # operator name -> calls

    def count(self, func, args: tuple, kwargs: dict, out) -> Optional[tuple[str, int]]:
        """Add one call: its operator's name and bytes, or None when it moves nothing."""
        if func.namespace == "profiler" or func.is_view:
            return None
        name = func.overloadpacket.__name__
        if name in FREE:
            return None
        moved = moved_bytes(name, args, kwargs, out)
        self.ops += 1
        self.bytes += moved
        self.by_op[name] += moved
        self.calls[name] += 1
        return name, moved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count(func, args, kwargs, out)
        return out


class Roofline(Traffic):
    """:class:`Traffic` plus each call's FLOPs (torch.utils.flop_counter's formulas; operators it
    has none for count 0, ``extra_flops`` adds those of custom operators by name) and its floor
    ``max(bytes / bandwidth, flops / peak)`` in seconds, summed per operator."""

    def __init__(self, bandwidth: float, peak: float, extra_flops: Optional[dict] = None) -> None:
        super().__init__()
        self.bandwidth, self.peak = bandwidth, peak
        self.extra_flops = extra_flops or {}
        self.flops = 0
        self.flops_by_op: Counter = Counter()
        self.floor_by_op: Counter = Counter()    # operator name -> seconds

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counted = self.count(func, args, kwargs, out)
        if counted is not None:
            name, moved = counted
            formula = flop_registry.get(func.overloadpacket)
            flops = formula(*args, **kwargs, out_val=out) if formula else 0
            if name in self.extra_flops:
                flops += self.extra_flops[name](args, out)
            self.flops += flops
            self.flops_by_op[name] += flops
            self.floor_by_op[name] += max(moved / self.bandwidth, flops / self.peak)
        return out

    @property
    def floor_s(self) -> float:
        return sum(self.floor_by_op.values())


def varlen_attention_flops(lengths: Sequence[int], heads: int, head_dim: int, causal: bool) -> tuple[int, int]:
    """Forward and backward FLOPs of attention within segments of ``lengths``: scores and the weighted
    sum, 4·heads·head_dim·Σ len² forward (half of that causal: the kernels skip masked tiles), and
    2.5 times the forward backward (the flash kernels' recomputation of the scores included)."""
    fwd = 4 * heads * head_dim * sum(n * n for n in lengths)
    fwd = fwd // 2 if causal else fwd
    return fwd, int(2.5 * fwd)
