"""One per-token loss over a whole optimizer step, whatever the batch layout.

The objective of a step is  L = (Σ token CE over all micro-batches and ranks) / G
with G = Σ label tokens over the same. Each rank learns G with ONE small
all-reduce before any backward, then back-propagates ``loss_sum * W / G`` per
micro-batch: DDP/FSDP average gradients over the W ranks, so the W cancels and
the summed gradient is exactly dL. No micro-batch or rank is weighted by its
own token count, so packing, padding and accumulation cannot change it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from west.batch import IGNORE_INDEX, Batch
from west.train.distributed import all_reduce_sum


def count_label_tokens(batch: Batch) -> int:
    """Label positions (labels != IGNORE_INDEX): the loss denominator's share of this batch."""
    return int((batch.labels != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class StepPlan:
    """What every rank must agree on before the first backward of a step."""

    local_tokens: int
    global_tokens: int
    global_real_batches: int  # 0 -> every rank is out of data: the epoch is over

    def loss_scale(self, world_size: int) -> float:
        """Multiplier for a micro-batch's summed CE (DDP divides gradients by world_size)."""
        return world_size / max(self.global_tokens, 1)


def plan_step(micro_batches: Sequence[Batch], n_real: int) -> StepPlan:
    """All-reduce [label tokens, real micro-batches] of this rank's step in one collective."""
    local = sum(count_label_tokens(b) for b in micro_batches)
    tokens, real = all_reduce_sum([local, n_real])
    return StepPlan(local, int(tokens), int(real))


class TooManyBadSteps(RuntimeError):
    """Raised (on every rank at the same step) after max_bad_steps non-finite steps in a row."""


class BadStepGuard:
    """Counts skipped non-finite steps; consistent across ranks because its input is global."""

    def __init__(self, max_in_row: int):
        self.max_in_row = max_in_row
        self.in_row = 0
        self.total = 0

    def update(self, bad: bool, step: int) -> None:
        if not bad:
            self.in_row = 0
            return
        self.in_row += 1
        self.total += 1
        if self.in_row >= self.max_in_row:
            raise TooManyBadSteps(f"{self.in_row} non-finite (NaN/inf) steps in a row up to step {step} "
                                  f"(train.max_bad_steps={self.max_in_row}); stopping")

    def state_dict(self) -> dict:
        return {"in_row": self.in_row, "total": self.total}

    def load_state_dict(self, sd: dict) -> None:
        self.in_row, self.total = int(sd["in_row"]), int(sd["total"])
