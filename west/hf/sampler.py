"""Which samples share a packed row, for every rank and every epoch.

The rows come from west's planner (west.data.packing.pack): best-fit decreasing, and with
several ranks steps of exactly one row per rank whose token counts (or Σlen², ``cost="square"``)
are balanced. The order of the steps is shuffled by (seed, epoch), the same on every rank
without communication. Every sample appears exactly once per epoch; nothing is truncated (a
sample longer than the row is refused up front, naming its index). ``state_dict`` /
``load_state_dict`` resume in the middle of an epoch.

A plan can leave a rank without a row in a step (fewer samples than rank slots: three long
samples on two ranks make two steps of two rows, one of them empty). A rank without a row would
leave the others waiting mid-epoch, so such a plan is refused when the sampler is built, with the
numbers, unless ``empty_rows="dummy"``: the empty row then becomes ``[-1 - i]`` (``i`` the
shortest sample), which :class:`west.hf.trainer.PackingMixin`'s dataset reads as sample ``i``
with every label -100: a row the rank computes and that contributes nothing to loss or gradient.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from west.data.packing import pack


class PackedBatchSampler(Sampler[list[int]]):
    """Yields this rank's rows (lists of dataset indices) of the current epoch."""

    def __init__(self, lengths: Sequence[int], pack_length: int, *, world_size: int = 1, rank: int = 0,
                 seed: int = 0, shuffle: bool = True, algorithm: str = "bfd", cost: str = "linear",
                 empty_rows: str = "refuse") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if empty_rows not in ("refuse", "dummy"):
            raise ValueError(f"empty_rows must be 'refuse' or 'dummy', got {empty_rows!r}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.shape[0] == 0:
            raise ValueError("PackedBatchSampler got no samples")
        self.empty_rows = empty_rows
        over = np.flatnonzero(self.lengths > int(pack_length))
        if over.size:
            i = int(over[0])
            raise ValueError(f"sample {i} has {int(self.lengths[i])} tokens, more than pack_length={int(pack_length)} "
                             f"({over.size} sample(s) do): west never truncates; raise pack_length, or drop or split "
                             "the long samples first")
        self.pack_length, self.world_size, self.rank = int(pack_length), int(world_size), int(rank)
        self.seed, self.shuffle, self.algorithm, self.cost = int(seed), shuffle, algorithm, cost
        self.epoch, self.consumed = 0, 0
        self._steps = self._plan()   # validates the lengths at construction (ValueError names an index)

    def _plan(self) -> list[list[list[int]]]:
        """Steps of ``world_size`` rows: the same plan every epoch, the order shuffled per epoch."""
        plan = pack(self.lengths, self.pack_length, algorithm=self.algorithm, dp_size=self.world_size,
                    cost=self.cost)
        steps = [[row] for row in plan] if self.world_size == 1 else plan
        empty = [(i, r) for i, step in enumerate(steps) for r, row in enumerate(step) if not row]
        if empty and self.empty_rows == "refuse":
            ranks = sorted({r for _, r in empty})
            raise ValueError(
                f"{len(self.lengths)} samples packed into rows of {self.pack_length} tokens make {len(steps)} steps "
                f"of {self.world_size} rows, and {len(empty)} of those {len(steps) * self.world_size} rows are empty "
                f"(rank(s) {ranks} would have no row in a step and the others would wait for them mid-epoch): "
                "pass empty_rows='dummy' (a row that contributes nothing, what PackingMixin does), use fewer "
                "ranks, or more or shorter samples")
        dummy = [-1 - int(np.argmin(self.lengths))]
        return [[row if row else list(dummy) for row in step] for step in steps]

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (Trainer / accelerate call it each epoch)."""
        if epoch != self.epoch:
            self.epoch, self.consumed = int(epoch), 0

    def rows(self, epoch: int) -> list[list[int]]:
        """This rank's rows of ``epoch``, in order."""
        order = np.arange(len(self._steps))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        return [list(self._steps[s][self.rank]) for s in order]

    def __iter__(self) -> Iterator[list[int]]:
        rows = self.rows(self.epoch)
        start = self.consumed
        for i in range(start, len(rows)):
            self.consumed = i + 1
            yield rows[i]
        self.epoch, self.consumed = self.epoch + 1, 0   # the next iteration is the next epoch

    def __len__(self) -> int:
        return len(self._steps)

    def state_dict(self) -> dict:
        """Where this rank is: epoch and rows already handed out."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "rank", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler {getattr(self, key)}")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
