"""Segment lengths rounded up to a few buckets per octave, so that segments of nearly equal length
share one attention call (west.models.attention groups a packed row's segments by them; the
shared-prefix attention lays out its key rows the same way)."""
from __future__ import annotations

from typing import Optional


def bucket_length(n: int, buckets_per_octave: Optional[int], longest: Optional[int] = None) -> int:
    """Length segment ``n`` is padded to inside its group (``n`` itself if bucketing is off).

    With ``b`` buckets per octave a segment is padded by less than 1/b of its
    length, so attention FLOPs grow by < (1+1/b)² while the number of SDPA calls
    drops from "distinct lengths" to ~b·log2(max/min). ``b = 0``: one group, every
    segment padded to ``longest`` (the fewest operators, the most padded FLOPs)."""
    if buckets_per_octave == 0:
        return n if longest is None else longest
    if not buckets_per_octave or n <= buckets_per_octave:
        return n
    step = max(1, (1 << (n.bit_length() - 1)) // buckets_per_octave)
    return -(-n // step) * step
