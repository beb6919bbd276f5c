"""West-train's loop with no loader beside it: a diagnosis of the GPU runs' open question.

On an H200 west-train's step took 1.27x the benchmark's at the same packs and configuration, the
extra time in phases of a few small operators each (projector, splice, loss: 30, 16 and 17 ms of
host time against about 1, 1 and 3 in the benchmark's runner; docs/notebook.md, run 8).
The two run the same step function; what differs is what runs beside it. West-train has a loader
(worker processes computing features, a pin-memory thread) and its loop's own work (logging, the
NVML sampler, the late read-back's bookkeeping); the benchmark's runner has batches collated
beforehand. :class:`PreloadedData` takes the first ``n`` batches from west-train's own loader
once, ends the loader (its worker processes exit, its pin-memory thread stops), then serves those
batches from memory, pinned as the loader gave them: west-train's loop and everything else as
configured, without the loader. Its step against west-train's plain one says which side the extra
time is on. Not for training: every epoch repeats the same ``n`` batches.
"""
from __future__ import annotations

import gc
import threading
from typing import Iterator, Optional

import psutil

from west.batch import Batch


class PreloadedData:
    """A TrainData (west.train.data_interface) serving ``data``'s first ``n`` batches from memory."""

    def __init__(self, data, n: int) -> None:
        if n < 1:
            raise ValueError(f"preload needs at least one batch, got {n}")
        self.data, self.n = data, n
        self.batches: Optional[list[Batch]] = None
        self.note = ""

    def _load(self) -> list[Batch]:
        before = {t.ident for t in threading.enumerate()}
        it = iter(self.data)
        batches = [b for _, b in zip(range(self.n), it)]
        close = getattr(it, "close", None)
        if close is not None:
            close()   # a generator: its frame drops the DataLoader's iterator, which ends the workers
        del it
        gc.collect()
        if not batches:
            raise ValueError("preload: the loader gave no batch")
        workers = len(psutil.Process().children(recursive=True))
        threads = sorted(t.name for t in threading.enumerate() if t.ident not in before)
        self.note = (f"preloaded {len(batches)} batches from the loader, then ended it: {workers} child processes "
                     f"and {len(threads)} new threads left{' (' + ', '.join(threads) + ')' if threads else ''}")
        print(f"[preload] {self.note}", flush=True)
        return batches

    def __iter__(self) -> Iterator[Batch]:
        if self.batches is None:
            self.batches = self._load()
        return iter(self.batches)

    def __len__(self) -> int:
        return self.n if self.batches is None else len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        if self.batches is None:
            self.data.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.data.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.data.load_state_dict(state)

    def dummy_batch(self) -> Batch:
        return self.data.dummy_batch()

    def pack_extent(self):
        return self.data.pack_extent()

    def skipped_counts(self) -> dict:
        counts = getattr(self.data, "skipped_counts", None)
        return counts() if counts is not None else {}
