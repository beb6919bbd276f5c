"""Compiled kernels that turn packed items into balanced data-parallel steps (numba).

A step is ``dp`` bins, one per rank; these kernels decide which items share a
step and even out the bins of each step (see ``west.data.packing._plan_steps``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from west.data.packing_kernels import tree_next, tree_set, tree_size


@njit(cache=True)
def _bucket_remove(head, prv, nxt, tree, size, room, b):
    if prv[b] >= 0:
        nxt[prv[b]] = nxt[b]
    else:
        head[room] = nxt[b]
        if nxt[b] < 0:
            tree_set(tree, size, room, 0)
    if nxt[b] >= 0:
        prv[nxt[b]] = prv[b]


@njit(cache=True)
def _bucket_add(head, prv, nxt, tree, size, room, b):
    prv[b] = -1
    nxt[b] = head[room]
    if head[room] >= 0:
        prv[head[room]] = b
    else:
        tree_set(tree, size, room, 1)
    head[room] = b



@njit(cache=True)
def balance_step(bins: np.ndarray, lens: np.ndarray, costs: np.ndarray,
                 n_bins: int, capacity: int, max_rounds: int) -> None:
    """Even out the cost of the ``n_bins`` bins of one training step, in place.

    ``bins[k]`` is item k's bin (0..n_bins-1), ``lens[k]`` its length, ``costs[k]``
    its cost. Each round takes the costliest and the cheapest bin and applies the
    single move or pairwise swap whose transferred cost is closest to half their
    gap, subject to capacity; it stops when no such transfer narrows the gap.
    """
    m = lens.shape[0]
    bin_cost = np.zeros(n_bins, np.float64)
    bin_len = np.zeros(n_bins, np.int64)
    for k in range(m):
        bin_cost[bins[k]] += costs[k]
        bin_len[bins[k]] += lens[k]
    hi_items = np.empty(m, np.int64)
    lo_items = np.empty(m, np.int64)
    for _ in range(max_rounds):
        hi = 0
        lo = 0
        for b in range(1, n_bins):
            if bin_cost[b] > bin_cost[hi]:
                hi = b
            if bin_cost[b] < bin_cost[lo]:
                lo = b
        gap = bin_cost[hi] - bin_cost[lo]
        if gap <= 1e-9 * bin_cost[hi]:
            return
        half = gap / 2.0
        n_hi = 0
        n_lo = 0
        for k in range(m):
            if bins[k] == hi:
                hi_items[n_hi] = k
                n_hi += 1
            elif bins[k] == lo:
                lo_items[n_lo] = k
                n_lo += 1
        lo_sorted = lo_items[:n_lo][np.argsort(costs[lo_items[:n_lo]])]
        lo_costs = costs[lo_sorted]
        room_lo = capacity - bin_len[lo]
        room_hi = capacity - bin_len[hi]
        best_err = half  # a transfer d narrows the gap iff |d - half| < half
        best_a = -1
        best_c = -1
        for t in range(n_hi):
            a = hi_items[t]
            ca = costs[a]
            if lens[a] <= room_lo:
                err = abs(ca - half)
                if err < best_err:
                    best_err = err
                    best_a = a
                    best_c = -1
            # swap partner: the lo item whose cost is nearest to ca - half
            p = np.searchsorted(lo_costs, ca - half)
            for q in range(max(p - 4, 0), min(p + 4, n_lo)):
                c = lo_sorted[q]
                d = ca - costs[c]
                if d <= 0.0:
                    continue
                if lens[a] - lens[c] > room_lo or lens[c] - lens[a] > room_hi:
                    continue
                err = abs(d - half)
                if err < best_err:
                    best_err = err
                    best_a = a
                    best_c = c
        if best_a < 0:
            return
        bins[best_a] = lo
        bin_cost[hi] -= costs[best_a]
        bin_cost[lo] += costs[best_a]
        bin_len[hi] -= lens[best_a]
        bin_len[lo] += lens[best_a]
        if best_c >= 0:
            bins[best_c] = hi
            bin_cost[lo] -= costs[best_c]
            bin_cost[hi] += costs[best_c]
            bin_len[lo] -= lens[best_c]
            bin_len[hi] += lens[best_c]


@njit(cache=True)
def balance_steps(step_ptr: np.ndarray, bins: np.ndarray, lens: np.ndarray, costs: np.ndarray,
                  n_bins: int, capacity: int, max_rounds: int) -> None:
    """``balance_step`` on every step; step s owns items step_ptr[s]:step_ptr[s+1]."""
    for s in range(step_ptr.shape[0] - 1):
        a = step_ptr[s]
        b = step_ptr[s + 1]
        if b - a > 1:
            balance_step(bins[a:b], lens[a:b], costs[a:b], n_bins, capacity, max_rounds)


@njit(cache=True)
def _less(cost: np.ndarray, x: int, y: int) -> bool:
    return cost[x] < cost[y] or (cost[x] == cost[y] and x < y)


@njit(cache=True)
def _swap(heap: np.ndarray, pos: np.ndarray, a: int, b: int) -> None:
    heap[a], heap[b] = heap[b], heap[a]
    pos[heap[a]] = a
    pos[heap[b]] = b


@njit(cache=True)
def _sift_up(heap: np.ndarray, pos: np.ndarray, cost: np.ndarray, i: int) -> None:
    while i > 0:
        p = (i - 1) >> 1
        if not _less(cost, heap[i], heap[p]):
            break
        _swap(heap, pos, i, p)
        i = p


@njit(cache=True)
def _sift_down(heap: np.ndarray, pos: np.ndarray, cost: np.ndarray, i: int, m: int) -> None:
    while True:
        l = 2 * i + 1
        if l >= m:
            break
        s = l
        if l + 1 < m and _less(cost, heap[l + 1], heap[l]):
            s = l + 1
        if not _less(cost, heap[s], heap[i]):
            break
        _swap(heap, pos, i, s)
        i = s


@njit(cache=True)
def _heap_pop(heap: np.ndarray, pos: np.ndarray, cost: np.ndarray, m: int) -> int:
    """Remove the root bin (read by the caller first); returns the new size."""
    m -= 1
    pos[heap[0]] = -1
    if m > 0:
        heap[0] = heap[m]
        pos[heap[0]] = 0
        _sift_down(heap, pos, cost, 0, m)
    return m


@njit(cache=True)
def _heap_push(heap: np.ndarray, pos: np.ndarray, cost: np.ndarray, m: int, b: int) -> int:
    heap[m] = b
    pos[b] = m
    _sift_up(heap, pos, cost, m)
    return m + 1


@njit(cache=True)
def least_loaded_fit(lengths: np.ndarray, order: np.ndarray, costs: np.ndarray,
                     n_bins: int, capacity: int, grow: int):
    """Deal items (in ``order``, longest first) each to the cheapest bin that still
    has room: longest-processing-time scheduling under a capacity.

    An indexed cost heap gives the cheapest bins; when the cheapest few have no
    room the item goes best-fit instead (room buckets + flag tree, built on first
    need), so one item never scans many bins. When an item fits nowhere, ``grow``
    empty bins are added. Returns (assignment, number of bins).
    """
    n = lengths.shape[0]
    max_scan = 16
    limit = n_bins + n + grow
    heap = np.empty(limit, np.int64)        # bins by (cost, id); pos[b] = -1 once out
    pos = np.full(limit, -1, np.int64)
    cost = np.zeros(limit, np.float64)
    room = np.full(limit, capacity, np.int64)
    m = 0
    for b in range(n_bins):
        m = _heap_push(heap, pos, cost, m, b)
    size = tree_size(capacity)
    tree = np.zeros(2 * size, np.uint8)
    head = np.full(capacity + 1, -1, np.int64)
    prv = np.full(limit, -1, np.int64)
    nxt = np.full(limit, -1, np.int64)
    buckets = False
    stash = np.empty(max_scan, np.int64)
    assign = np.empty(n, np.int64)
    min_len = capacity
    for i in range(n):
        min_len = min(min_len, lengths[i])
    for k in range(n):
        i = order[k]
        need = lengths[i]
        n_stash = 0
        b = -1
        while m > 0 and n_stash < max_scan:
            cand = heap[0]
            if room[cand] >= need:
                b = cand
                break
            m = _heap_pop(heap, pos, cost, m)
            if room[cand] >= min_len:          # may still take a shorter item later
                stash[n_stash] = cand
                n_stash += 1
        for s in range(n_stash):
            m = _heap_push(heap, pos, cost, m, stash[s])
        if b < 0:
            if not buckets:
                for c in range(n_bins - 1, -1, -1):
                    _bucket_add(head, prv, nxt, tree, size, room[c], c)
                buckets = True
            r = tree_next(tree, size, need)
            if r < 0:
                for c in range(n_bins, n_bins + grow):
                    m = _heap_push(heap, pos, cost, m, c)
                    _bucket_add(head, prv, nxt, tree, size, capacity, c)
                n_bins += grow
                r = capacity
            b = head[r]
        assign[i] = b
        if buckets:
            _bucket_remove(head, prv, nxt, tree, size, room[b], b)
            _bucket_add(head, prv, nxt, tree, size, room[b] - need, b)
        room[b] -= need
        cost[b] += costs[i]
        if pos[b] >= 0:
            _sift_down(heap, pos, cost, pos[b], m)
    return assign, n_bins





@njit(cache=True)
def grouped_best_fit(lengths: np.ndarray, order: np.ndarray, costs: np.ndarray, capacity: int, dp: int):
    """Best-fit decreasing over groups of ``dp`` bins (one group = one training step).

    A group's key is the largest room among its bins; each item (longest first)
    goes to the open group with the smallest key that still holds it, and within
    that group to the cheapest bin with room. Groups fill as tightly as plain
    best-fit bins while their bins stay even. Returns (slot = group*dp + bin,
    number of groups).
    """
    n = lengths.shape[0]
    size = tree_size(capacity)
    tree = np.zeros(2 * size, np.uint8)
    head = np.full(capacity + 1, -1, np.int64)
    max_groups = n + 1
    prv = np.full(max_groups, -1, np.int64)
    nxt = np.full(max_groups, -1, np.int64)
    key = np.zeros(max_groups, np.int64)
    room = np.empty(max_groups * dp, np.int64)
    cost = np.zeros(max_groups * dp, np.float64)
    slot = np.empty(n, np.int64)
    n_groups = 0
    for k in range(n):
        i = order[k]
        need = lengths[i]
        r = tree_next(tree, size, need)
        if r < 0:
            g = n_groups
            n_groups += 1
            for j in range(dp):
                room[g * dp + j] = capacity
                cost[g * dp + j] = 0.0
        else:
            g = head[r]
            _bucket_remove(head, prv, nxt, tree, size, r, g)
        best = -1
        for j in range(g * dp, g * dp + dp):
            if room[j] >= need and (best < 0 or cost[j] < cost[best]):
                best = j
        slot[i] = best
        room[best] -= need
        cost[best] += costs[i]
        kmax = 0
        for j in range(g * dp, g * dp + dp):
            kmax = max(kmax, room[j])
        key[g] = kmax
        if kmax > 0:
            _bucket_add(head, prv, nxt, tree, size, kmax, g)
    return slot, n_groups
