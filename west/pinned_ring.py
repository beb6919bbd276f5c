"""One page-locked ring for the small host-built tensors a training step copies to its GPU.

A packed step copies about eight index tensors to the GPU mid-step (the subsampling's placement,
the layout's rows, the projector's destinations, the label positions, the step's figures). Each
must be page-locked for the copy to be asynchronous. ``Tensor.pin_memory()`` allocates that
from torch's caching host allocator, which calls ``cudaHostAlloc`` whenever it has no free
block of the rounded size; that call page-locks memory under a driver-wide lock and can hold the
launching thread for milliseconds, longer while the loader's pin thread page-locks a batch
beside it. The GPU idles meanwhile (docs/benchmarks.md: one idle gap of 11-23 ms per pack
step, each ended by such a copy).

:class:`PinnedRing` allocates its page-locked bytes once. Each copy takes the next free slice,
writes the tensor there, queues the copy and records an event after it; a slice is written again
only after the event of every earlier copy that read it has completed. ``train.pinned_ring_mib``
turns it on for a run (:func:`use_pinned_ring`); :func:`west.batch.to_device` then sends its
copies through it.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Optional

import torch

ALIGN = 64          # every slice starts on this many bytes: any dtype's view of it is aligned


def _page_locked(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _device_copy(staged: torch.Tensor, device: torch.device) -> torch.Tensor:
    return staged.to(device, non_blocking=True)


class PinnedRing:
    """Page-locked bytes allocated once, reused in ring order behind the copies that read them.

    ``alloc``, ``copy`` and ``new_event`` default to page-locked memory, a non-blocking copy and a
    CUDA event on the current stream; the tests give fakes that model a device running behind."""

    def __init__(self, capacity: int, device: torch.device | str,
                 alloc: Callable[[int], torch.Tensor] = _page_locked,
                 copy: Callable[[torch.Tensor, torch.device], torch.Tensor] = _device_copy,
                 new_event: Optional[Callable[[], object]] = None):
        if capacity < 4 * ALIGN:
            raise ValueError(f"PinnedRing: capacity {capacity} bytes is under {4 * ALIGN}")
        self.capacity, self.device = capacity, torch.device(device)
        self.buf = alloc(capacity)
        self._copy = copy
        self._new_event = new_event or torch.cuda.Event
        self._head = 0
        self._inflight: deque = deque()     # (start, end, event) in the order the slices were taken
        self._spare: list = []              # completed events, recorded again instead of made anew
        self._lock = threading.Lock()
        self.copies = self.waits = self.wraps = self.too_large = 0

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes through the ring: at most half of it (a larger tensor is pinned on its own)."""
        return t.numel() * t.element_size() <= self.capacity // 2

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a CPU tensor) on the ring's device: written into the next free slice, copied from
        there without a host sync. A tensor that does not :meth:`fit` is pinned on its own."""
        if not self.fits(t):
            self.too_large += 1
            return self._copy(t.pin_memory(), self.device)
        nbytes = t.numel() * t.element_size()
        with self._lock:
            start = self._take(max(nbytes, 1))
            staged = self.buf[start:start + nbytes].view(t.dtype).view(t.shape)
            staged.copy_(t)
            out = self._copy(staged, self.device)
            event = self._spare.pop() if self._spare else self._new_event()
            event.record()
            self._inflight.append((start, start + _aligned(max(nbytes, 1)), event))
            self.copies += 1
        return out

    def _take(self, nbytes: int) -> int:
        """The start of ``nbytes`` free bytes at the head, wrapping to 0 when the tail is short;
        waits for the copies still reading any byte it hands out (or skips over on a wrap)."""
        size = _aligned(nbytes)
        start = self._head
        if start + size > self.capacity:
            claimed = ((start, self.capacity), (0, size))   # the skipped tail, and the slice at 0
            start = 0
            self.wraps += 1
        else:
            claimed = ((start, start + size),)
        # Slices are taken in ring order, so the ones a new claim overlaps are the oldest in flight.
        while self._inflight:
            s, e, event = self._inflight[0]
            if not event.query():
                if not any(s < hi and lo < e for lo, hi in claimed):
                    break
                event.synchronize()
                self.waits += 1
            self._spare.append(event)
            self._inflight.popleft()
        self._head = start + size
        return start

    def summary(self) -> str:
        """One line for the run's summary. A wait held the host until an earlier copy completed:
        more than a few mean the ring is too small for what the GPU has queued."""
        text = (f"pinned ring of {self.capacity / 2**20:g} MiB: {self.copies:,} copies, {self.waits:,} waits, "
                f"{self.wraps:,} wraps")
        return text + (f", {self.too_large:,} too large (pinned apart)" if self.too_large else "")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


_ring: Optional[PinnedRing] = None


def use_pinned_ring(mib: float, device: torch.device | str) -> Optional[PinnedRing]:
    """``train.pinned_ring_mib``, for the whole process: a ring of ``mib`` MiB for copies to
    ``device`` (a CUDA device; elsewhere, or with 0, none and copies pin their own memory).
    Returns the ring in use, or None."""
    global _ring
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:   # tensors name their device with its index
        device = torch.device("cuda", torch.cuda.current_device())
    if mib <= 0 or device.type != "cuda":
        _ring = None
    elif _ring is None or _ring.device != device or _ring.capacity != int(mib * 2**20):
        _ring = PinnedRing(int(mib * 2**20), device)
    return _ring


def ring_for(device: torch.device) -> Optional[PinnedRing]:
    """The process's ring if it serves ``device``, else None."""
    return _ring if _ring is not None and _ring.device == device else None
