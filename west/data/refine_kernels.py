"""Compiled repair pass of the bin packer (numba): close gaps in packed bins from a pool.

Best-fit decreasing leaves a few bins part-empty; this pass dissolves the least-filled
ones into a pool and lets every other bin take (or swap for) pool items that close its
gap, then re-packs what is left. Kept apart from the placement kernels in
``packing_kernels``: it consumes their output and shares only their index helpers.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from west.data.packing_kernels import best_fit_decreasing, group_order, tree_prev, tree_set, tree_size


@njit(cache=True)
def refine_fill(lengths: np.ndarray, assign: np.ndarray, n_bins: int, n_pool: int, capacity: int) -> np.ndarray:
    """Fill the gaps of packed bins from a pool, then re-pack the pool.

    The ``n_pool`` least-filled bins become a pool of loose items. Every other bin
    with a gap takes the pool item (move) or swaps one of its items for a longer
    pool item (swap) so as to close as much of its gap as possible, repeatedly.
    The pool only shrinks in total length, and is then packed again best-fit
    decreasing. Returns a new assignment with bins renumbered from 0; the caller
    keeps it only if it uses fewer bins.
    """
    n = lengths.shape[0]
    fill = np.zeros(n_bins, np.int64)
    for i in range(n):
        fill[assign[i]] += lengths[i]
    by_fill = np.argsort(fill, kind="mergesort")
    in_pool = np.zeros(n_bins, np.uint8)
    for k in range(n_pool):
        in_pool[by_fill[k]] = 1
    # pool: per-length LIFO stacks of items plus a flag tree over lengths
    size = tree_size(capacity)
    tree = np.zeros(2 * size, np.uint8)
    head = np.full(capacity + 1, -1, np.int64)
    nxt = np.full(n, -1, np.int64)
    for i in range(n):
        if in_pool[assign[i]]:
            v = lengths[i]
            nxt[i] = head[v]
            if head[v] < 0:
                tree_set(tree, size, v, 1)
            head[v] = i
    # members of kept bins, grouped by bin
    members, start = group_order(assign, n_bins)
    # members of equal length give the same swap: each length is tried once per search
    seen = np.zeros(capacity + 1, np.int64)
    stamp = 0
    new_assign = assign.copy()
    for b in range(n_bins):
        if in_pool[b]:
            continue
        gap = capacity - fill[b]
        while gap > 0:
            stamp += 1
            best_gain = 0
            best_out = -1     # index into members, -1 for a pure move
            best_val = -1
            v = tree_prev(tree, size, gap)
            if v > 0:
                best_gain = v
                best_val = v
            for k in range(start[b], start[b + 1]):
                if best_gain == gap:
                    break
                a = members[k]
                la = lengths[a]
                if seen[la] == stamp:
                    continue
                seen[la] = stamp
                v = tree_prev(tree, size, la + gap)
                if v > la and v - la > best_gain:
                    best_gain = v - la
                    best_val = v
                    best_out = k
                    if best_gain == gap:
                        break
            if best_gain <= 0:
                break
            item = head[best_val]
            head[best_val] = nxt[item]
            if head[best_val] < 0:
                tree_set(tree, size, best_val, 0)
            new_assign[item] = b
            if best_out >= 0:
                a = members[best_out]
                members[best_out] = item
                la = lengths[a]
                nxt[a] = head[la]
                if head[la] < 0:
                    tree_set(tree, size, la, 1)
                head[la] = a
                new_assign[a] = -1
            else:
                # a moved-in item is not a swap candidate later; only gaps matter
                pass
            gap -= best_gain
            fill[b] += best_gain
    # renumber kept bins, then best-fit the pool into fresh bins
    remap = np.full(n_bins, -1, np.int64)
    kept = 0
    for b in range(n_bins):
        if not in_pool[b]:
            remap[b] = kept
            kept += 1
    pool_n = 0
    for v in range(capacity, 0, -1):
        i = head[v]
        while i >= 0:
            pool_n += 1
            i = nxt[i]
    pool_items = np.empty(pool_n, np.int64)
    pool_lens = np.empty(pool_n, np.int64)
    k = 0
    for v in range(capacity, 0, -1):
        i = head[v]
        while i >= 0:
            pool_items[k] = i
            pool_lens[k] = v
            k += 1
            i = nxt[i]
    for i in range(n):
        if new_assign[i] >= 0 and not in_pool[new_assign[i]]:
            new_assign[i] = remap[new_assign[i]]
    if pool_n > 0:
        # pool_items are already in decreasing length order
        order = np.arange(pool_n)
        sub = best_fit_decreasing(pool_lens, order, capacity)
        for k in range(pool_n):
            new_assign[pool_items[k]] = kept + sub[k]
    return new_assign
