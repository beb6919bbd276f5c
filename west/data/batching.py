"""Grouping rules on lengths only, in array form (the batching policies call these).

A window of samples becomes batches as ``(order, sizes)``: ``order`` lists the
window positions batch after batch, ``sizes[b]`` is how many of them batch b
holds. Nothing is ever dropped: ``sizes.sum() == len(order)``. Arrays instead
of lists of lists keep planning 10M utterances within a second or two and far
below a gigabyte.
"""
from __future__ import annotations

import numba
import numpy as np

from west.data.packing import pack


def static_sizes(n: int, batch_size: int) -> np.ndarray:
    """``batch_size`` samples per batch, the last one shorter."""
    sizes = np.full(n // batch_size, batch_size, np.int64)
    return np.append(sizes, n % batch_size) if n % batch_size else sizes


@numba.njit(cache=True)
def _dynamic_sizes(lengths: np.ndarray, max_tokens: int) -> np.ndarray:
    sizes = np.empty(lengths.shape[0], np.int64)
    n_batches, count, longest = 0, 0, 0
    for n in lengths:
        if count and max(longest, n) * (count + 1) > max_tokens:
            sizes[n_batches] = count
            n_batches += 1
            count, longest = 0, 0
        count += 1
        longest = max(longest, n)
    if count:
        sizes[n_batches] = count
        n_batches += 1
    return sizes[:n_batches]


def dynamic_sizes(lengths: np.ndarray, max_tokens: int) -> np.ndarray:
    """Padding-aware grouping in the given order: a batch closes when
    ``longest * (n + 1)`` would exceed ``max_tokens`` (the padded size memory pays for)."""
    return _dynamic_sizes(np.ascontiguousarray(lengths, np.int64), int(max_tokens))


def sort_in_windows(lengths: np.ndarray, window: int) -> np.ndarray:
    """Permutation sorting by length inside consecutive windows (stable), like WeNet's sort buffer."""
    n = lengths.shape[0]
    return np.lexsort((np.asarray(lengths), np.arange(n) // max(1, window)))


def equalize_rounds(sizes: np.ndarray, world_size: int) -> np.ndarray:
    """Make the number of batches a multiple of ``world_size`` without dropping anything.

    While it is not, the batch with the most samples of the last, partial round
    is split in two (falling back to any batch, then to an empty batch that the
    loader serves as a dummy when there are fewer samples than ranks). Members
    keep their order, so only ``sizes`` changes."""
    out = [int(x) for x in sizes]
    while len(out) % world_size:
        tail = range(len(out) - len(out) % world_size, len(out))
        donor = max(tail, key=lambda i: (out[i], i))
        if out[donor] < 2:
            donor = max(range(len(out)), key=lambda i: (out[i], i))
        if out[donor] < 2:
            out.append(0)
            continue
        h = out[donor] // 2
        out[donor:donor + 1] = [h, out[donor] - h]
    return np.asarray(out, np.int64)


def split_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Split one planned pack into rows when decoded lengths exceed the plan (rare)."""
    return pack(np.asarray(lengths, np.int64), capacity, algorithm="nf")
