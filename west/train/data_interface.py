"""What the training loop needs from the data side, as a protocol: west.data.dataset.WestDataLoader
implements it, and a test or another data pipeline can too, without the loop importing west.data."""
from __future__ import annotations

from typing import Iterator, Protocol

from west.batch import Batch


class TrainData(Protocol):
    """What the loop needs from the data side (one object per rank).

    ``set_epoch(e)`` starts epoch e from its beginning; iterating yields this
    rank's remaining batches of the current epoch; ``state_dict()`` is the
    position after the last batch yielded; ``load_state_dict`` makes the next
    iteration continue from there; ``dummy_batch()`` is what this rank computes (at zero
    weight) in a step where it has no batch left, so every rank runs the same collectives.
    Optional: ``skipped_counts() -> dict`` (bad inputs skipped so far this epoch),
    ``__len__`` (batches per epoch on this rank, used to size the cosine schedule of
    epoch-limited runs) and ``pack_extent() -> west.shapes.PackExtent`` (what the fullest of
    this rank's batches of the epoch hold in the encoder: the shape ``train.encoder_graphs``
    captures its blocks at). west.data.dataset.WestDataLoader is one.
    """

    def set_epoch(self, epoch: int) -> None: ...
    def __iter__(self) -> Iterator[Batch]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def dummy_batch(self) -> Batch: ...
