"""Group samples into batches: static, dynamic (padding-aware) and pack.

Grouping looks at lengths only (LLM tokens: prompt + speech slots + transcript).
The same rules serve the streamed pipeline (generators over decoded samples)
and the epoch planner (lists of indices), so both modes batch identically.

* static: ``batch_size`` samples per batch.
* dynamic: a batch closes when ``longest * (n + 1)`` would exceed
  ``max_tokens_in_batch`` — the padded size, which is what memory pays for.
* pack (streamed): ``west.data.packing.pack`` over windows of ``pack_buffer``
  items; the least-filled bin (for ``nf``: the open bin) is carried into the
  next window so window edges do not leave half-empty rows. (A planned epoch
  is packed in one call instead, see ``west.data.plan``.)
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional, Sequence, TypeVar

import numpy as np

from west.data.packing import pack

T = TypeVar("T")


def static_groups(items: Sequence[T], batch_size: int) -> list[list[T]]:
    return [list(items[i:i + batch_size]) for i in range(0, len(items), batch_size)]


def dynamic_groups(items: Sequence[T], lengths: Sequence[int], max_tokens: int) -> list[list[T]]:
    """Padding-aware grouping in the given order: close when longest*(n+1) > max_tokens."""
    out, batch, longest = [], [], 0
    for it, n in zip(items, lengths):
        if batch and max(longest, n) * (len(batch) + 1) > max_tokens:
            out.append(batch)
            batch, longest = [], 0
        batch.append(it)
        longest = max(longest, n)
    if batch:
        out.append(batch)
    return out


def sort_windows(items: Sequence[T], lengths: Sequence[int], window: int) -> list[T]:
    """Sort items by length inside consecutive windows (stable), like WeNet's sort buffer."""
    out: list[T] = []
    for i in range(0, len(items), window):
        chunk = list(range(i, min(i + window, len(items))))
        chunk.sort(key=lambda j: lengths[j])
        out += [items[j] for j in chunk]
    return out


def pack_windows(items: Iterable[T], length: Callable[[T], int], capacity: int, window: int,
                 algorithm: str = "bfd") -> Iterator[list[T]]:
    """Pack a stream of items into bins, ``window`` items at a time.

    After packing a window, its least-filled bin (for ``nf``: the open, last
    bin) goes back into the buffer to be completed by the next window; the
    final flush emits everything.
    """
    buf: list[T] = []
    trigger = window
    for_stream = algorithm == "nf"

    def run(final: bool) -> list[list[T]]:
        nonlocal buf, trigger
        lens = np.fromiter((length(x) for x in buf), np.int64, len(buf))
        bins = pack(lens, capacity, algorithm=algorithm)
        carry = -1
        if not final:
            if len(bins) < 2:                      # not one closed bin yet: wait for more items
                trigger = len(buf) + window
                return []
            carry = len(bins) - 1 if for_stream else int(np.argmin([lens[b].sum() for b in bins]))
        out = [[buf[i] for i in b] for j, b in enumerate(bins) if j != carry]
        buf = [buf[i] for i in sorted(bins[carry])] if carry >= 0 else []
        trigger = len(buf) + window
        return out

    for it in items:
        buf.append(it)
        if len(buf) >= trigger:
            yield from run(final=False)
    if buf:
        yield from run(final=True)


def shuffle_buffer(samples: Iterable[T], size: int, rng: np.random.Generator) -> Iterator[T]:
    """WeNet-style buffer shuffle: fill ``size`` items, emit them in random order."""
    buf: list[T] = []
    for s in samples:
        buf.append(s)
        if len(buf) >= size:
            for i in rng.permutation(len(buf)):
                yield buf[i]
            buf = []
    for i in rng.permutation(len(buf)):
        yield buf[i]


def sort_buffer(samples: Iterable[dict], size: int) -> Iterator[dict]:
    """Sort decoded samples by length inside windows of ``size``."""
    buf: list[dict] = []
    for s in samples:
        buf.append(s)
        if len(buf) >= size:
            yield from sorted(buf, key=lambda x: x["length"])
            buf = []
    yield from sorted(buf, key=lambda x: x["length"])


def batch_samples(samples: Iterable[dict], batch_type: str, batch_size: int, max_tokens: int,
                  pack_tokens: int, pack_buffer: int, algorithm: str) -> Iterator[list[dict]]:
    """Streamed batching of decoded samples (each has ``length``)."""
    if batch_type == "pack":
        yield from pack_windows(samples, lambda s: s["length"], pack_tokens, pack_buffer, algorithm)
        return
    batch: list[dict] = []
    longest = 0
    for s in samples:
        n = s["length"]
        full = (len(batch) >= batch_size if batch_type == "static"
                else bool(batch) and max(longest, n) * (len(batch) + 1) > max_tokens)
        if full:
            yield batch
            batch, longest = [], 0
        batch.append(s)
        longest = max(longest, n)
    if batch:
        yield batch


def next_fit_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Split one planned pack into rows when decoded lengths exceed the plan (rare)."""
    return pack(np.asarray(lengths, np.int64), capacity, algorithm="nf")


def equalize_rounds(batches: list[list[T]], world_size: int) -> list[list[T]]:
    """Make ``len(batches)`` a multiple of ``world_size`` without dropping anything.

    While it is not, split the batch with the most samples of the last, partial
    round in two (falling back to any batch, then to an empty batch that the
    loader serves as a dummy when there are fewer samples than ranks).
    """
    out = [list(b) for b in batches]
    while len(out) % world_size:
        partial = len(out) % world_size
        tail = range(len(out) - partial, len(out))
        donor: Optional[int] = max(tail, key=lambda i: (len(out[i]), i))
        if len(out[donor]) < 2:
            best = max(range(len(out)), key=lambda i: (len(out[i]), i), default=None)
            donor = best if best is not None and len(out[best]) >= 2 else None
        if donor is None:
            out.append([])
            continue
        b = out[donor]
        h = len(b) // 2
        out[donor:donor + 1] = [b[:h], b[h:]]
    return out
