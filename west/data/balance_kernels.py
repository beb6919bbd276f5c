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
def polish_steps(slot: np.ndarray, lengths: np.ndarray, costs: np.ndarray, n_steps: int, dp: int,
                 capacity: int, max_rounds: int, tol: float) -> int:
    """``balance_step`` on every step whose costliest bin exceeds its cheapest by more
    than the fraction ``tol`` (an empty bin always counts), in place on ``slot``
    (item -> step * dp + rank). Items are grouped by step with a counting sort, so
    the pass is O(n) plus the local searches. Returns the number of steps searched."""
    n = lengths.shape[0]
    total = n_steps * dp
    bin_cost = np.zeros(total, np.float64)
    for i in range(n):
        bin_cost[slot[i]] += costs[i]
    todo = np.zeros(n_steps, np.uint8)
    n_todo = 0
    for s in range(n_steps):
        lo = bin_cost[s * dp]
        hi = lo
        for b in range(s * dp + 1, s * dp + dp):
            lo = min(lo, bin_cost[b])
            hi = max(hi, bin_cost[b])
        if hi > 0.0 and (lo <= 0.0 or hi > (1.0 + tol) * lo):
            todo[s] = 1
            n_todo += 1
    if n_todo == 0:
        return 0
    ptr = np.zeros(n_steps + 1, np.int64)
    for i in range(n):
        s = slot[i] // dp
        if todo[s]:
            ptr[s + 1] += 1
    for s in range(n_steps):
        ptr[s + 1] += ptr[s]
    m = ptr[n_steps]
    items = np.empty(m, np.int64)
    cursor = ptr[:-1].copy()
    for i in range(n):
        s = slot[i] // dp
        if todo[s]:
            items[cursor[s]] = i
            cursor[s] += 1
    local = np.empty(m, np.int64)
    lens = np.empty(m, np.int64)
    cst = np.empty(m, np.float64)
    for k in range(m):
        i = items[k]
        local[k] = slot[i] % dp
        lens[k] = lengths[i]
        cst[k] = costs[i]
    for s in range(n_steps):
        a = ptr[s]
        b = ptr[s + 1]
        if b - a > 1:
            balance_step(local[a:b], lens[a:b], cst[a:b], dp, capacity, max_rounds)
            for k in range(a, b):
                slot[items[k]] = s * dp + local[k]
    return n_todo


@njit(cache=True)
def grouped_best_fit(lengths: np.ndarray, order: np.ndarray, costs: np.ndarray, capacity: int, dp: int):
    """Best-fit decreasing over groups of ``dp`` bins (one group = one training step).

    A group's key is the largest room among its bins; each item (longest first)
    goes to the open group with the smallest key that still holds it, and within
    that group to the cheapest bin with room (lowest rank on ties). Groups fill as
    tightly as plain best-fit bins while their bins stay even. Returns (slot =
    group * dp + bin, number of groups).

    Items of equal length skip the search while the group that took the previous
    one still holds them: its key was the smallest >= that length and only
    shrank, and it sits first in its room bucket, so the search would return it
    again. The result is exactly the item-by-item one with far fewer tree steps.
    """
    n = lengths.shape[0]
    size = tree_size(capacity)
    tree = np.zeros(2 * size, np.uint8)
    head = np.full(capacity + 1, -1, np.int64)
    # A group opens only when every bin of every open group holds an item (an empty
    # bin would have room), so there are at most ceil(n / dp) groups. Arrays stay
    # uninitialised (numba zero-fills by writing) and are set when a group opens.
    max_groups = (n + dp - 1) // dp
    prv = np.empty(max_groups, np.int64)
    nxt = np.empty(max_groups, np.int64)
    key = np.empty(max_groups, np.int64)
    room = np.empty(max_groups * dp, np.int64)
    cost = np.empty(max_groups * dp, np.float64)
    slot = np.empty(n, np.int64)
    n_groups = 0
    g = -1          # group that took the previous item, out of the buckets
    last = -1       # its length
    for k in range(n):
        i = order[k]
        need = lengths[i]
        if g >= 0 and (need != last or key[g] < need):
            if key[g] > 0:
                _bucket_add(head, prv, nxt, tree, size, key[g], g)
            g = -1
        if g < 0:
            r = tree_next(tree, size, need)
            if r >= 0:
                g = head[r]
                _bucket_remove(head, prv, nxt, tree, size, r, g)
            else:
                g = n_groups
                n_groups += 1
                for j in range(g * dp, g * dp + dp):
                    room[j] = capacity
                    cost[j] = 0.0
        last = need
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
    return slot, n_groups
