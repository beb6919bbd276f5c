"""Compiled inner loops of the bin packer (numba, nopython).

Why numba: best-fit decreasing over a million items needs a per-item search
over open bins; a Python loop takes seconds, numpy cannot express the
sequential dependency, and numba installs from PyPI wheels with no compiler.

Bins are described by an ``assign`` array (item -> bin id); everything here
works on int64 arrays and returns arrays, never Python objects.
"""
from __future__ import annotations

import numpy as np
from numba import njit

# Largest capacity for which best-fit indexes bins by their remaining capacity
# directly (a segment tree with one leaf per capacity value: 2**22 leaves is
# 4 MiB of flags). Larger capacities use the sorted-array variant.
DIRECT_INDEX_MAX_CAPACITY = 1 << 22


@njit(cache=True)
def order_desc(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Item indices by decreasing length, ties by increasing index (counting sort)."""
    n = lengths.shape[0]
    counts = np.zeros(capacity + 2, np.int64)
    for i in range(n):
        counts[lengths[i]] += 1
    start = np.zeros(capacity + 2, np.int64)
    acc = 0
    for v in range(capacity, 0, -1):
        start[v] = acc
        acc += counts[v]
    order = np.empty(n, np.int64)
    for i in range(n):
        v = lengths[i]
        order[start[v]] = i
        start[v] += 1
    return order


@njit(cache=True)
def next_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Streaming next-fit in input order: one open bin, closed when an item does not fit."""
    n = lengths.shape[0]
    assign = np.empty(n, np.int64)
    b = 0
    used = 0
    for i in range(n):
        if used + lengths[i] > capacity:
            b += 1
            used = 0
        assign[i] = b
        used += lengths[i]
    return assign


@njit(cache=True)
def tree_set(tree: np.ndarray, size: int, leaf: int, flag: int) -> None:
    i = leaf + size
    tree[i] = flag
    i >>= 1
    while i >= 1:
        v = tree[2 * i] | tree[2 * i + 1]
        if tree[i] == v:
            break
        tree[i] = v
        i >>= 1


@njit(cache=True)
def _tree_find(tree: np.ndarray, size: int, x: int, forward: bool) -> int:
    """Nearest leaf index to ``x`` (at or after it if ``forward``, else at or before it)
    whose flag is set, or -1: climb until a sibling on that side has a flag, then descend."""
    if (forward and x >= size) or (not forward and x < 0):
        return -1
    x = min(x, size - 1)
    i = x + size
    if tree[i]:
        return x
    while True:
        if i == 1:
            return -1
        sibling = i + 1 if forward else i - 1
        if ((i & 1) == 0) == forward and tree[sibling]:
            i = sibling
            break
        i >>= 1
    while i < size:
        near, far = (2 * i, 2 * i + 1) if forward else (2 * i + 1, 2 * i)
        i = near if tree[near] else far
    return i - size


@njit(cache=True)
def tree_next(tree: np.ndarray, size: int, x: int) -> int:
    """Smallest leaf index >= x whose flag is set, or -1."""
    return _tree_find(tree, size, x, True)


@njit(cache=True)
def tree_prev(tree: np.ndarray, size: int, x: int) -> int:
    """Largest leaf index <= x whose flag is set, or -1."""
    return _tree_find(tree, size, x, False)


@njit(cache=True)
def tree_size(capacity: int) -> int:
    size = 1
    while size < capacity + 1:
        size <<= 1
    return size


@njit(cache=True)
def value_counts(lengths: np.ndarray, capacity: int) -> np.ndarray:
    counts = np.zeros(capacity + 1, np.int64)
    for i in range(lengths.shape[0]):
        counts[lengths[i]] += 1
    return counts


@njit(cache=True)
def _assign_from_events(order: np.ndarray, ev_bin: np.ndarray, ev_cnt: np.ndarray, n_events: int) -> np.ndarray:
    """Events are in the same value-descending order as ``order``: walk both."""
    assign = np.empty(order.shape[0], np.int64)
    pos = 0
    for e in range(n_events):
        b = ev_bin[e]
        for _ in range(ev_cnt[e]):
            assign[order[pos]] = b
            pos += 1
    return assign


@njit(cache=True)
def _record(ev_bin: np.ndarray, ev_cnt: np.ndarray, n_events: int, b: int, k: int) -> int:
    """Note that ``k`` equal items went into bin ``b``; returns the new event count."""
    ev_bin[n_events] = b
    ev_cnt[n_events] = k
    return n_events + 1


@njit(cache=True)
def best_fit_decreasing(lengths: np.ndarray, order: np.ndarray, capacity: int) -> np.ndarray:
    """Best-fit decreasing: each item goes to the open bin with the least room that
    still holds it.

    Items of equal length are placed as a group: the best bin for one item of
    length v stays the best for the next one while its room is >= v, so it takes
    min(count, room // v) of them at once, which gives exactly the item-by-item
    result. Open bins sit in LIFO buckets by remaining room; a flag tree finds
    the smallest non-empty bucket >= v in O(log capacity).
    """
    counts = value_counts(lengths, capacity)
    n = lengths.shape[0]
    size = tree_size(capacity)
    tree = np.zeros(2 * size, np.uint8)
    head = np.full(capacity + 1, -1, np.int64)
    nxt = np.empty(n, np.int64)
    ev_bin, ev_cnt = np.empty(n, np.int64), np.empty(n, np.int64)   # (bin, count) placements
    n_events = n_bins = 0
    for v in range(capacity, 0, -1):
        c = counts[v]
        while c > 0:
            r = tree_next(tree, size, v)
            if r < 0:
                b = n_bins
                n_bins += 1
                room = capacity
            else:
                b = head[r]
                head[r] = nxt[b]
                if head[r] < 0:
                    tree_set(tree, size, r, 0)
                room = r
            k = min(c, room // v)
            n_events = _record(ev_bin, ev_cnt, n_events, b, k)
            c -= k
            room -= k * v
            if room > 0:
                nxt[b] = head[room]
                head[room] = b
                tree_set(tree, size, room, 1)
    return _assign_from_events(order, ev_bin, ev_cnt, n_events)


@njit(cache=True)
def group_order(assign: np.ndarray, n_groups: int):
    """Counting sort of items by group: (items grouped, ascending within a group;
    group boundaries of length n_groups + 1)."""
    n = assign.shape[0]
    bounds = np.zeros(n_groups + 1, np.int64)
    for i in range(n):
        bounds[assign[i] + 1] += 1
    for g in range(n_groups):
        bounds[g + 1] += bounds[g]
    cursor = bounds[:-1].copy()
    order = np.empty(n, np.int64)
    for i in range(n):
        g = assign[i]
        order[cursor[g]] = i
        cursor[g] += 1
    return order, bounds


@njit(cache=True)
def _first_with_room(room: np.ndarray, size: int, need: int) -> int:
    """Lowest-numbered bin whose room >= need in a max-tree over bins (caller checked room[1])."""
    j = 1
    while j < size:
        j = 2 * j if room[2 * j] >= need else 2 * j + 1
    return j - size


@njit(cache=True)
def _first_fit_bin(room: np.ndarray, size: int, need: int, n_bins: int, capacity: int):
    """(lowest-numbered bin with room >= need, opening a new one if none has; bins now open)."""
    if room[1] >= need:
        return _first_with_room(room, size, need), n_bins
    room[n_bins + size] = capacity
    return n_bins, n_bins + 1


@njit(cache=True)
def _take_room(room: np.ndarray, size: int, b: int, amount: int) -> None:
    j = b + size
    room[j] -= amount
    j >>= 1
    while j >= 1:
        room[j] = max(room[2 * j], room[2 * j + 1])
        j >>= 1


@njit(cache=True)
def first_fit_decreasing(lengths: np.ndarray, order: np.ndarray, capacity: int) -> np.ndarray:
    """First-fit decreasing: the lowest-numbered open bin with room, found with a
    max-tree over bins' remaining room; equal lengths placed as a group as in
    ``best_fit_decreasing``."""
    counts = value_counts(lengths, capacity)
    n = lengths.shape[0]
    size = 1
    while size < max(n, 1):
        size <<= 1
    room = np.zeros(2 * size, np.int64)
    ev_bin, ev_cnt = np.empty(n, np.int64), np.empty(n, np.int64)   # (bin, count) placements
    n_events = n_bins = 0
    for v in range(capacity, 0, -1):
        c = counts[v]
        while c > 0:
            b, n_bins = _first_fit_bin(room, size, v, n_bins, capacity)
            k = min(c, room[b + size] // v)
            n_events = _record(ev_bin, ev_cnt, n_events, b, k)
            c -= k
            _take_room(room, size, b, k * v)
    return _assign_from_events(order, ev_bin, ev_cnt, n_events)


@njit(cache=True)
def best_fit_sorted(lengths: np.ndarray, order: np.ndarray, capacity: int) -> np.ndarray:
    """Item-by-item best-fit for capacities too large to index by room: open bins
    kept sorted by remaining room (binary search + shift)."""
    n = lengths.shape[0]
    rooms = np.empty(n, np.int64)
    bins = np.empty(n, np.int64)
    m = 0
    assign = np.empty(n, np.int64)
    n_bins = 0
    for k in range(n):
        i = order[k]
        need = lengths[i]
        pos = np.searchsorted(rooms[:m], need)
        if pos == m:
            b = n_bins
            n_bins += 1
            room = capacity - need
        else:
            b = bins[pos]
            room = rooms[pos] - need
            for j in range(pos, m - 1):
                rooms[j] = rooms[j + 1]
                bins[j] = bins[j + 1]
            m -= 1
        assign[i] = b
        if room > 0:
            q = np.searchsorted(rooms[:m], room)
            for j in range(m, q, -1):
                rooms[j] = rooms[j - 1]
                bins[j] = bins[j - 1]
            rooms[q] = room
            bins[q] = b
            m += 1
    return assign


@njit(cache=True)
def first_fit_itemwise(lengths: np.ndarray, order: np.ndarray, capacity: int) -> np.ndarray:
    """Item-by-item first-fit (max-tree over bins), for capacities too large to
    count lengths by value."""
    n = lengths.shape[0]
    size = 1
    while size < max(n, 1):
        size <<= 1
    room = np.zeros(2 * size, np.int64)
    assign = np.empty(n, np.int64)
    n_bins = 0
    for k in range(n):
        i = order[k]
        need = lengths[i]
        b, n_bins = _first_fit_bin(room, size, need, n_bins, capacity)
        assign[i] = b
        _take_room(room, size, b, need)
    return assign
