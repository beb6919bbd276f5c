"""The largest batch size that fits a memory budget: doubling from a start size, then bisection.

``largest_fitting(trial, lo, hi)`` knows nothing about models: ``trial(size)`` returns True
when that size fits and False when it ran out of memory. Memory only grows with the size
(a bigger budget never makes the worst batch smaller), so one doubling run finds the first
size that does not fit and a bisection between it and the last one that did finds the
boundary to ``granularity``. Every size is tried at most once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


class NothingFits(RuntimeError):
    """Even the smallest size ran out of memory."""


@dataclass
class SearchResult:
    size: int                 # the largest size that fitted
    capped: bool              # True: ``hi`` itself fitted (the budget may allow more than the search allows)
    trials: list = field(default_factory=list)   # [(size, fitted)] in the order tried


def _round(x: int, granularity: int, above: int) -> int:
    """``x`` rounded down to a multiple of ``granularity`` when that stays above ``above``, else ``x``."""
    r = x - x % granularity
    return r if r > above else x


def largest_fitting(trial: Callable[[int], bool], lo: int, hi: int, start: Optional[int] = None,
                    granularity: int = 1, log: Callable[[str], None] = lambda s: None) -> SearchResult:
    """Largest size in [lo, hi] for which ``trial`` returns True, to within ``granularity``
    (sizes tried after the start are multiples of it where possible, never above ``hi``).
    Starts at ``start`` (default ``lo``), doubles while it fits, then bisects. Raises
    :class:`NothingFits` when ``lo`` does not fit."""
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")
    tried: dict[int, bool] = {}
    order: list = []

    def fits(size: int) -> bool:
        if size not in tried:
            tried[size] = bool(trial(size))
            order.append((size, tried[size]))
            log(f"size {size}: {'fits' if tried[size] else 'out of memory'}")
        return tried[size]

    size = min(max(start if start is not None else lo, lo), hi)
    ok: Optional[int] = None
    while fits(size):                       # doubling
        ok = size
        if size >= hi:
            return SearchResult(size, True, order)
        size = min(_round(2 * size, granularity, size), hi)
    bad = size
    if ok is None:                          # the start size did not fit: the boundary is below it
        if bad == lo or not fits(lo):
            raise NothingFits(f"even the smallest size {lo} ran out of memory")
        ok = lo
    while bad - ok > granularity:           # bisection: ok fits, bad does not
        mid = _round((ok + bad) // 2, granularity, ok)
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return SearchResult(ok, False, order)
