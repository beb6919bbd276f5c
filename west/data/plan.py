"""Plan a whole epoch from lengths so every rank gets the same number of steps.

Input: the record indices that passed the metadata filters and every record's
LLM-token length. Output: ``steps[s][rank]`` = indices of the batch that rank
trains on at step s. Every index appears exactly once; nothing is dropped.

* pack: one ``pack(lengths, pack_tokens, pack_algorithm, dp_size=world_size,
  cost=pack_cost)`` call over the whole epoch (in shuffled order), so the packs
  of one step have balanced cost and only the last step can hold partly filled
  rows; the steps are then shuffled. (Packing windows of ``pack_buffer`` would
  leave up to world_size-1 half-empty rows per window; the packer plans 1M
  lengths in well under a second, so the whole epoch is one window.)
* static / dynamic: batches are formed globally, then dealt ``world_size`` at
  a time; when their number is not a multiple of ``world_size`` batches of the
  last round are split (see ``batching.equalize_rounds``).
An empty batch (only when there are fewer samples than ranks) is served as a
dummy batch. Same (seed, epoch, lengths, config) -> same plan on any machine.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from west.data.batching import dynamic_groups, equalize_rounds, sort_windows, static_groups
from west.data.config import DataConfig
from west.data.packing import pack


def _fill_empty_bins(steps: list[list[list[int]]]) -> None:
    """Give an empty pack an item of the pack with the most items (prefer the same step)."""
    for step in steps:
        for b, members in enumerate(step):
            if members:
                continue
            local = max(step, key=len)
            donor = local if len(local) >= 2 else max((x for s in steps for x in s), key=len)
            if len(donor) >= 2:
                step[b] = [donor.pop()]


def plan_epoch(indices: np.ndarray, lengths: np.ndarray, conf: DataConfig, world_size: int,
               rng: Optional[np.random.Generator]) -> list[list[list[int]]]:
    """Steps of ``world_size`` batches of record indices (see module doc)."""
    order = [int(i) for i in (rng.permutation(indices) if rng is not None else indices)]
    if conf.batch_type == "pack":
        steps = pack(lengths[order], conf.pack_tokens, algorithm=conf.pack_algorithm, dp_size=world_size,
                     cost=conf.pack_cost) if order else []
        if world_size == 1:
            steps = [[b] for b in steps]
        steps = [[[order[i] for i in b] for b in step] for step in steps]
        _fill_empty_bins(steps)
        if rng is not None:
            steps = [steps[i] for i in rng.permutation(len(steps))]
        return steps
    if conf.batch_type == "static":
        batches = static_groups(order, conf.batch_size)
    else:
        order = sort_windows(order, [int(lengths[i]) for i in order], conf.sort_buffer)
        batches = dynamic_groups(order, [int(lengths[i]) for i in order], conf.max_tokens_in_batch)
        if rng is not None:
            batches = [batches[i] for i in rng.permutation(len(batches))]
    batches = equalize_rounds(batches, world_size)
    return [batches[i:i + world_size] for i in range(0, len(batches), world_size)]
