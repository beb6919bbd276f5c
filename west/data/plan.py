"""Plan a whole epoch from lengths, the same way on every rank and machine.

1. ``epoch_order``: which records the epoch holds, in which order. One list:
   all its usable records. Several lists with weights: list i contributes a
   share ``w_i / Σw`` of the epoch (the epoch has as many samples as the lists
   have usable records together); a list's samples are drawn from an endless
   stream of its shuffled copies, so over the epochs every record comes up
   equally often. Then the whole order is shuffled (training only).
2. ``plan_epoch``: the order is cut into windows of ``window`` samples; the
   batching policy turns each window into steps of ``world_size`` batches; the
   steps of all windows are shuffled together. Windows bound the cost of
   grouping (packing is superlinear) and leave at most one partly filled step
   per window.

The result depends only on the lengths, (seed, epoch), the config and the world
size; never on ``num_workers`` or on which machine runs it. Every record of the
order lands in exactly one batch; nothing is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from west.data.policies import BatchPolicy


@dataclass
class EpochPlan:
    """Batches as flat arrays: batch b holds ``members[bounds[b]:bounds[b+1]]``;
    step s is batches ``s * world_size .. s * world_size + world_size - 1``."""

    members: np.ndarray
    bounds: np.ndarray
    world_size: int

    @property
    def n_steps(self) -> int:
        return (self.bounds.shape[0] - 1) // self.world_size

    def batch(self, b: int) -> np.ndarray:
        return self.members[self.bounds[b]:self.bounds[b + 1]]

    def rank_batches(self, rank: int) -> list[np.ndarray]:
        """Record ids of every batch rank ``rank`` trains on, in step order."""
        return [self.batch(s * self.world_size + rank) for s in range(self.n_steps)]


def _cycled(n: int, count: int, start: int, rng_seed: Optional[Sequence[int]]) -> np.ndarray:
    """Items ``start .. start + count`` of an endless stream of permutations of ``range(n)``
    (permutation c drawn from ``rng_seed + [c]``; identity order without a seed)."""
    if n == 0 or count == 0:
        return np.zeros(0, np.int64)
    out, pos = [], start
    while pos < start + count:
        cycle, offset = divmod(pos, n)
        perm = np.arange(n) if rng_seed is None else np.random.default_rng([*rng_seed, cycle]).permutation(n)
        take = min(n - offset, start + count - pos)
        out.append(perm[offset:offset + take])
        pos += take
    return np.concatenate(out).astype(np.int64)


def list_shares(sizes: Sequence[int], weights: Optional[Sequence[float]]) -> np.ndarray:
    """Samples each list contributes to one epoch (largest remainders, summing to Σ sizes)."""
    sizes = np.asarray(sizes, np.int64)
    if weights is None:
        return sizes
    w = np.where(sizes > 0, np.asarray(weights, np.float64), 0.0)   # an empty list cannot contribute
    if not w.sum():
        return np.zeros_like(sizes)
    exact = sizes.sum() * w / w.sum()
    share = np.floor(exact).astype(np.int64)
    rest = int(sizes.sum() - share.sum())
    share[np.argsort(-(exact - share), kind="stable")[:rest]] += 1
    return share


def epoch_order(eligible: Sequence[np.ndarray], weights: Optional[Sequence[float]], seed: int, epoch: int,
                shuffle: bool) -> np.ndarray:
    """Global record ids of one epoch, in order (see the module doc).

    ``eligible[i]`` are the usable global ids of list i."""
    shares = list_shares([e.shape[0] for e in eligible], weights)
    parts = []
    for i, (ids, share) in enumerate(zip(eligible, shares)):
        if weights is None:   # plain concatenation: each record once
            parts.append(np.asarray(ids, np.int64))
            continue
        pos = _cycled(ids.shape[0], int(share), epoch * int(share), [seed, i] if shuffle else None)
        parts.append(np.asarray(ids, np.int64)[pos])
    order = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return np.random.default_rng([seed, epoch]).permutation(order) if shuffle else order


def plan_epoch(order: np.ndarray, lengths: np.ndarray, policy: BatchPolicy, world_size: int, window: int,
               rng: Optional[np.random.Generator]) -> EpochPlan:
    """Steps of ``world_size`` batches over ``order`` (record ids), window by window."""
    members, sizes = [], []
    for start in range(0, order.shape[0], window):
        ids = order[start:start + window]
        pos, size = policy.group(lengths[ids], world_size, rng)
        members.append(ids[pos])
        sizes.append(size)
    members_a = np.concatenate(members) if members else np.zeros(0, np.int64)
    sizes_a = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
    if rng is not None and sizes_a.shape[0]:
        members_a, sizes_a = _shuffle_steps(members_a, sizes_a, world_size, rng)
    return EpochPlan(members_a, np.concatenate([[0], np.cumsum(sizes_a)]).astype(np.int64), world_size)


def _shuffle_steps(members: np.ndarray, sizes: np.ndarray, world_size: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Reorder whole steps (``world_size`` consecutive batches) by a random permutation."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    n_steps = sizes.shape[0] // world_size
    perm = rng.permutation(n_steps)
    new_sizes = sizes.reshape(n_steps, world_size)[perm].reshape(-1)
    step_start, step_end = bounds[0:-1:world_size], bounds[world_size::world_size]
    # gather each step's member range in the new order without a Python loop per item
    starts, counts = step_start[perm], (step_end - step_start)[perm]
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    idx = np.arange(int(counts.sum())) + offsets
    return members[idx], new_sizes
