"""PackedBatchSampler: rows fit, every sample once per epoch across ranks, balanced, deterministic
by (seed, epoch), resumable mid-epoch."""
from __future__ import annotations

import numpy as np
import pytest

from west.hf import PackedBatchSampler

LENGTHS = np.random.default_rng(0).integers(5, 120, 300).tolist()


def epoch_rows(sampler: PackedBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("world", [1, 2])
def test_every_sample_once_per_epoch_and_rows_fit(world):
    ranks = [PackedBatchSampler(LENGTHS, 256, world_size=world, rank=r, seed=3) for r in range(world)]
    for epoch in (0, 1):
        rows = [epoch_rows(s, epoch) for s in ranks]
        assert len({len(r) for r in rows}) == 1, "every rank gets the same number of rows"
        flat = [i for r in rows for row in r for i in row]
        assert sorted(flat) == list(range(len(LENGTHS)))
        assert all(sum(LENGTHS[i] for i in row) <= 256 for r in rows for row in r)
        assert all(row for r in rows for row in r), "no empty row"


def test_ranks_get_balanced_rows():
    a, b = (PackedBatchSampler(LENGTHS, 256, world_size=2, rank=r, seed=3) for r in range(2))
    for ra, rb in zip(epoch_rows(a, 0), epoch_rows(b, 0)):
        ta, tb = sum(LENGTHS[i] for i in ra), sum(LENGTHS[i] for i in rb)
        assert abs(ta - tb) <= 0.1 * max(ta, tb) + 120   # one step's two rows: close in tokens


def test_deterministic_by_seed_and_epoch():
    one, two = PackedBatchSampler(LENGTHS, 256, seed=7), PackedBatchSampler(LENGTHS, 256, seed=7)
    assert epoch_rows(one, 0) == epoch_rows(two, 0)
    e0, e1 = epoch_rows(one, 0), epoch_rows(one, 1)
    assert e0 != e1 and sorted(map(sorted, e0)) == sorted(map(sorted, e1))   # same rows, another order
    assert epoch_rows(PackedBatchSampler(LENGTHS, 256, seed=8), 0) != e0


def test_resume_mid_epoch_gives_the_remaining_rows():
    s = PackedBatchSampler(LENGTHS, 256, world_size=2, rank=1, seed=3)
    s.set_epoch(2)
    full = list(s.rows(2))
    it = iter(s)
    head = [next(it), next(it), next(it)]
    state = s.state_dict()
    resumed = PackedBatchSampler(LENGTHS, 256, world_size=2, rank=1, seed=3)
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    with pytest.raises(ValueError, match="rank"):
        PackedBatchSampler(LENGTHS, 256, world_size=2, rank=0, seed=3).load_state_dict(state)


def test_a_sample_longer_than_the_row_is_refused_up_front():
    with pytest.raises(ValueError, match=r"sample 2 has 300 tokens, more than pack_length=256.*drop or split"):
        PackedBatchSampler([10, 20, 300], 256)


@pytest.mark.parametrize("lengths, empty", [([9, 9, 9], 1), ([10], 1), ([9] * 9, 7)])
def test_a_plan_that_leaves_a_rank_without_a_row_is_refused_with_the_numbers(lengths, empty):
    n_ranks = 2 if len(lengths) < 9 else 8
    with pytest.raises(ValueError, match=rf"{len(lengths)} samples .* {empty} of those \d+ rows are empty"):
        PackedBatchSampler(lengths, 10, world_size=n_ranks, rank=n_ranks - 1)


def test_dummy_rows_give_every_rank_a_row_in_every_step():
    ranks = [PackedBatchSampler([5, 7, 5], 8, world_size=2, rank=r, empty_rows="dummy") for r in range(2)]
    rows = [epoch_rows(s, 0) for s in ranks]
    assert [len(r) for r in rows] == [2, 2] and all(row for r in rows for row in r)
    real = sorted(i for r in rows for row in r for i in row if i >= 0)
    assert real == [0, 1, 2]                                 # every sample once, the dummy on top
    assert [i for r in rows for row in r for i in row if i < 0] == [-1]   # sample 0 (the shortest), as a dummy
