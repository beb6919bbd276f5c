"""Bin packing of variable-length samples into fixed-capacity rows.

Every batch mode and every rank plans with this one module. ``pack`` works on
lengths only (never on data), is deterministic for the same input, and never
truncates: an item longer than the capacity is an error the caller must count
and skip upstream.

* ``algorithm="nf"``: next-fit in input order, the streaming baseline.
* ``"ffd"``: first-fit decreasing.
* ``"bfd"``: best-fit decreasing (default), the tightest of the three.

With ``dp_size > 1`` bins are grouped into training steps of exactly
``dp_size`` bins (one per data-parallel rank) whose work is balanced, measured
as Σlen (``cost="linear"``) or Σlen² (``cost="square"``, attention cost).
"""
from __future__ import annotations

import gc
import numbers
from typing import Sequence

import numpy as np

from west.data import balance_kernels as B
from west.data import packing_kernels as K
from west.data.refine_kernels import refine_fill

ALGORITHMS = ("nf", "ffd", "bfd")
COSTS = ("linear", "square")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _first_bad_value(values: np.ndarray, capacity: int) -> int:
    bad = (values <= 0) | (values > capacity)
    return int(np.argmax(bad)) if bad.any() else -1


def _reject(index: int, value, why: str):
    raise ValueError(f"lengths[{index}] = {value!r} {why}")


def as_lengths(lengths: Sequence[int] | np.ndarray, capacity: int) -> np.ndarray:
    """Validate ``lengths`` against ``capacity`` and return them as int64.

    Raises ValueError naming the first index that is not an integer (bools and
    floats included, even 3.0), not positive, or longer than ``capacity``.
    """
    capacity = _check_int("capacity", capacity, 1)
    if isinstance(lengths, np.ndarray) and lengths.dtype.kind in "iu":
        if lengths.ndim != 1:
            raise ValueError(f"lengths must be one-dimensional, got shape {lengths.shape}")
        values = lengths.astype(np.int64) if lengths.dtype != np.uint64 else np.minimum(lengths, 2**62).astype(np.int64)
        i = _first_bad_value(values, capacity)
        if i >= 0:
            _reject(i, lengths[i].item(), "is not positive" if values[i] <= 0 else f"is longer than capacity {capacity}")
        return values
    if isinstance(lengths, np.ndarray) and lengths.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {lengths.shape}")
    seq = lengths.tolist() if isinstance(lengths, np.ndarray) else list(lengths)
    first_non_int = len(seq)
    for i, v in enumerate(seq):
        t = type(v)
        if t is not int and not issubclass(t, np.integer):
            first_non_int = i
            break
    head = [min(max(int(v), -1), capacity + 1) for v in seq[:first_non_int]]
    values = np.asarray(head, dtype=np.int64)
    i = _first_bad_value(values, capacity)
    if i >= 0:
        _reject(i, seq[i], "is not positive" if values[i] <= 0 else f"is longer than capacity {capacity}")
    if first_non_int < len(seq):
        _reject(first_non_int, seq[first_non_int], "is not an integer")
    return values


def assign_bins(lengths: np.ndarray, capacity: int, algorithm: str = "bfd") -> np.ndarray:
    """Bin id of every item, bins numbered from 0 with no gaps."""
    if algorithm == "nf":
        return K.next_fit(lengths, capacity)
    direct = capacity <= K.DIRECT_INDEX_MAX_CAPACITY
    order = K.order_desc(lengths, capacity) if direct else np.argsort(-lengths, kind="stable").astype(np.int64)
    if algorithm == "ffd":
        return (K.first_fit_decreasing if direct else K.first_fit_itemwise)(lengths, order, capacity)
    if not direct:
        return K.best_fit_sorted(lengths, order, capacity)
    assign = K.best_fit_decreasing(lengths, order, capacity)
    return _refine(lengths, assign, capacity)


def _refine(lengths: np.ndarray, assign: np.ndarray, capacity: int, max_passes: int = 4) -> np.ndarray:
    """Close the gaps best-fit leaves, while that saves bins (see ``refine_fill``)."""
    lower = -(-int(lengths.sum()) // capacity)
    n_bins = int(assign.max()) + 1
    for _ in range(max_passes):
        if n_bins <= lower:
            break
        # a pool of ~1% of the bins has enough variety of lengths to close
        # nearly every gap in one pass; it must at least hold the excess bins
        pool = min(max(n_bins - lower + 1, n_bins // 100), n_bins)
        candidate = refine_fill(lengths, assign, n_bins, pool, capacity)
        got = int(candidate.max()) + 1
        if got >= n_bins:
            break
        assign, n_bins = candidate, got
    return assign


def _group(assign: np.ndarray, n_groups: int, dp_size: int = 1) -> list:
    """Items of each group id 0..n_groups-1, ascending within a group; with
    ``dp_size > 1`` cut into steps of ``dp_size`` groups.

    The cyclic garbage collector is paused while the lists are made: they hold
    only ints, yet at 10^5 bins its repeated scans of the new lists cost more
    than building them."""
    order, bounds = K.group_order(assign, n_groups)
    flat, bounds = order.tolist(), bounds.tolist()
    enabled = gc.isenabled()
    gc.disable()
    try:
        bins = [flat[bounds[g]:bounds[g + 1]] for g in range(n_groups)]
        if dp_size == 1:
            return bins
        return [bins[s:s + dp_size] for s in range(0, n_groups, dp_size)]
    finally:
        if enabled:
            gc.enable()


def pack(lengths: Sequence[int] | np.ndarray, capacity: int, algorithm: str = "bfd",
         dp_size: int = 1, cost: str = "linear"):
    """Pack item indices into bins whose length sums are <= ``capacity``.

    Returns ``list[list[int]]`` (bins of indices) for ``dp_size == 1``, or
    ``list[list[list[int]]]`` (steps of exactly ``dp_size`` bins) otherwise.
    Each index appears exactly once. A step has an empty bin only when there are
    fewer items than bins the capacity forces (steps × dp_size).
    """
    slot, n_bins = pack_slots(lengths, capacity, algorithm, dp_size, cost)
    if n_bins == 0:
        return []
    return _group(slot, n_bins, dp_size)


def pack_slots(lengths: Sequence[int] | np.ndarray, capacity: int, algorithm: str = "bfd",
               dp_size: int = 1, cost: str = "linear") -> tuple[np.ndarray, int]:
    """``pack`` as arrays: (bin of every item, number of bins). With ``dp_size > 1`` bin
    ``s * dp_size + r`` is rank r's bin of step s and the number of bins is a multiple
    of ``dp_size``. The epoch planner uses this form: no Python list per bin."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}, got {cost!r}")
    dp_size = _check_int("dp_size", dp_size, 1)
    values = as_lengths(lengths, capacity)
    if values.shape[0] == 0:
        return np.zeros(0, np.int64), 0
    if dp_size == 1:
        assign = assign_bins(values, int(capacity), algorithm)
        return assign, int(assign.max()) + 1
    slot, n_steps = _plan_steps(values, int(capacity), dp_size, cost, algorithm)
    return slot, n_steps * dp_size


# a step whose costliest bin exceeds its cheapest by more than this is evened out
POLISH_TOLERANCE = 1e-3


def _plan_steps(lengths: np.ndarray, capacity: int, dp_size: int, cost: str,
                algorithm: str) -> tuple[np.ndarray, int]:
    """Group items into balanced steps of ``dp_size`` bins: (slot of every item, steps).

    * "ffd"/"bfd": best-fit decreasing over whole steps (``grouped_best_fit``): a
      step is filled as tightly as a best-fit bin while each item goes to the
      cheapest of its bins, so the bins of a step stay even as they fill;
    * "nf" (and capacities too large to index by room): the packed bins ranked by
      cost and cut into steps, so that similar bins share a step.

    A local search then evens out every step that is still uneven, and an empty
    bin gets an item from a fuller one when there are enough items.
    """
    costs = lengths.astype(np.float64)
    if cost == "square":
        costs = costs * costs
    if algorithm != "nf" and capacity <= K.DIRECT_INDEX_MAX_CAPACITY:
        order = K.order_desc(lengths, capacity)
        slot, n_steps = B.grouped_best_fit(lengths, order, costs, capacity, dp_size)
    else:
        assign = assign_bins(lengths, capacity, algorithm)
        slot, n_steps = _ranked_slots(costs, assign, dp_size)
    B.polish_steps(slot, lengths, costs, n_steps, dp_size, capacity, 64 * dp_size, POLISH_TOLERANCE)
    _fill_empty_bins(slot, lengths, costs, n_steps * dp_size, dp_size, capacity)
    return slot, n_steps


def _ranked_slots(costs: np.ndarray, assign: np.ndarray, dp_size: int) -> tuple[np.ndarray, int]:
    """Slot (step * dp_size + rank) of every item: bins ranked by cost, cut into steps."""
    n_bins = int(assign.max()) + 1
    bin_cost = np.bincount(assign, weights=costs, minlength=n_bins)
    rank = np.empty(n_bins, np.int64)
    rank[np.argsort(-bin_cost, kind="stable")] = np.arange(n_bins)
    return rank[assign], -(-n_bins // dp_size)


def _fill_empty_bins(slot: np.ndarray, lengths: np.ndarray, costs: np.ndarray, total: int,
                     dp_size: int, capacity: int) -> None:
    """Give every empty bin an item when there are enough items (rare: only when a
    step had fewer items than ranks). Takes the shortest item of the fullest bin,
    then rebalances the two steps involved."""
    for _ in range(total):
        counts = np.bincount(slot, minlength=total)
        if counts.all() or slot.shape[0] < total:
            return
        empty = int(np.argmin(counts))
        donor = int(np.argmax(counts))
        members = np.nonzero(slot == donor)[0]
        item = members[np.argmin(lengths[members])]
        slot[item] = empty
        for step in {empty // dp_size, donor // dp_size}:
            idx = np.nonzero(slot // dp_size == step)[0]
            local = (slot[idx] % dp_size).astype(np.int64)
            B.balance_step(local, lengths[idx], costs[idx], dp_size, capacity, 64 * dp_size)
            slot[idx] = step * dp_size + local
