"""Batching rules, the batching policies and the epoch plan, on lengths only (no audio)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from west.data.batching import dynamic_sizes, equalize_rounds, sort_in_windows, static_sizes
from west.data.config import DataConfig
from west.data.plan import epoch_order, list_shares, plan_epoch
from west.data.policies import POLICIES, make_policy
from west.shapes import SpeechShape


def lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(20, 300, n)


def groups(order, sizes) -> list[list[int]]:
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [[int(i) for i in order[bounds[b]:bounds[b + 1]]] for b in range(len(sizes))]


def policy(**kw):
    return make_policy(DataConfig(**kw), 0, 1, SpeechShape())


@pytest.mark.parametrize("seed", range(5))
def test_dynamic_groups_respect_padded_budget(seed):
    lens = lengths(300, seed)
    gs = groups(np.arange(300), dynamic_sizes(lens, 1000))
    assert sorted(i for g in gs for i in g) == list(range(300))
    for i, g in enumerate(gs):
        assert max(lens[g]) * len(g) <= 1000
        if i + 1 < len(gs):     # closed only because the next sample would overflow
            nxt = gs[i + 1][0]
            assert max(max(lens[g]), lens[nxt]) * (len(g) + 1) > 1000


def test_dynamic_rule_counts_padding_not_sum():
    # sum 12 <= 16 but padded 8 * 3 = 24 > 16: the third sample starts a new batch
    assert dynamic_sizes(np.array([2, 8, 2]), 16).tolist() == [2, 1]


def test_static_and_sort_windows():
    assert static_sizes(10, 4).tolist() == [4, 4, 2] and static_sizes(8, 4).tolist() == [4, 4]
    perm = sort_in_windows(np.array([5, 4, 3, 2, 1, 0, 9, 8, 7, 6]), 5)
    assert perm.tolist() == [4, 3, 2, 1, 0, 5, 9, 8, 7, 6]


@pytest.mark.parametrize("n,world", [(10, 3), (7, 4), (2, 3), (0, 2), (9, 9), (33, 8)])
def test_equalize_rounds_never_drops(n, world):
    sizes = np.array([min(4, n - i) for i in range(0, n, 4)], np.int64)
    out = equalize_rounds(sizes, world)
    assert len(out) % world == 0 and out.sum() == n
    n_empty = int((out == 0).sum())
    assert n_empty == (0 if n >= world or n == 0 else world - n)   # dummies only with fewer samples than ranks
    # batches are only split, never merged: every old boundary is still a boundary (order kept)
    old = set(np.cumsum(sizes).tolist())
    assert old <= set(np.cumsum(out).tolist())


def test_every_mode_is_one_policy_with_its_size_key():
    assert {name: cls.size_key for name, cls in POLICIES.items()} == {
        "static": "batch_size", "dynamic": "max_tokens_in_batch", "pack": "pack_tokens"}
    assert policy(batch_type="pack", pack_tokens=900).sample_budget() == 900
    assert policy(batch_type="static").sample_budget() is None


@pytest.mark.parametrize("batch_type", ["static", "dynamic", "pack"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("window", [1000, 50])
def test_plan_equal_steps_cover_and_deterministic(batch_type, world, window):
    pol = policy(batch_type=batch_type, batch_size=7, max_tokens_in_batch=900, pack_tokens=900, sort_buffer=25)
    lens = lengths(203, 1)
    order = epoch_order([np.arange(203)], None, 0, 0, shuffle=True)
    plan = plan_epoch(order, lens, pol, world, window, np.random.default_rng([0, 0]))
    assert (len(plan.bounds) - 1) == plan.n_steps * world
    batches = [[int(i) for i in b] for r in range(world) for b in plan.rank_batches(r)]
    assert Counter(i for b in batches for i in b) == Counter(range(203))
    assert all(b for b in batches)           # enough samples: no dummy needed
    for b in batches:
        if batch_type == "pack":
            assert sum(lens[b]) <= 900
        if batch_type == "dynamic":
            assert max(lens[b]) * len(b) <= 900
        if batch_type == "static":
            assert len(b) <= 7
    again = plan_epoch(order, lens, pol, world, window, np.random.default_rng([0, 0]))
    assert np.array_equal(again.members, plan.members) and np.array_equal(again.bounds, plan.bounds)
    other = plan_epoch(order, lens, pol, world, window, np.random.default_rng([0, 1]))
    assert not np.array_equal(other.members, plan.members)


def test_pack_windows_leave_at_most_one_partial_step_each():
    lens = lengths(4000, 2)
    pol = policy(batch_type="pack", pack_tokens=2048)
    one = plan_epoch(np.arange(4000), lens, pol, 2, 4000, None)
    windowed = plan_epoch(np.arange(4000), lens, pol, 2, 1000, None)
    fill = [lens.sum() / (2048 * (len(p.bounds) - 1)) for p in (one, windowed)]
    assert fill[0] > 0.97 and fill[1] > 0.95 and windowed.n_steps <= one.n_steps + 4


def test_plan_with_fewer_samples_than_ranks_uses_dummies():
    plan = plan_epoch(np.arange(2), np.array([10, 20]), policy(batch_type="pack", pack_tokens=100), 4, 100, None)
    assert plan.n_steps == 1 and sorted(len(plan.batch(b)) for b in range(4)) == [0, 0, 1, 1]


def test_list_shares_follow_weights_and_sum_to_the_epoch():
    assert list_shares([100, 50], None).tolist() == [100, 50]
    assert list_shares([100, 50], [1, 1]).tolist() == [75, 75]
    assert list_shares([100, 50], [2, 1]).tolist() == [100, 50]
    assert list_shares([90, 10, 7], [1, 3, 1]).tolist() == [22, 64, 21]   # 107 * w / 5, largest remainders
    assert list_shares([90, 0], [1, 1]).tolist() == [90, 0]                # an empty list contributes nothing


@pytest.mark.parametrize("weights", [[1, 1], [3, 1], [1, 4]])
def test_weighted_mixing_proportions_and_coverage(weights):
    a, b = np.arange(0, 300), np.arange(300, 400)          # two lists, 300 and 100 records
    seen = Counter()
    for epoch in range(6):
        order = epoch_order([a, b], weights, seed=1, epoch=epoch, shuffle=True)
        assert len(order) == 400
        from_a = int((order < 300).sum())
        assert from_a == round(400 * weights[0] / sum(weights))   # each list's share, every epoch
        seen.update(order.tolist())
        assert order.tolist() == epoch_order([a, b], weights, 1, epoch, True).tolist()   # deterministic
    # over the epochs every record of a list comes up equally often (within one)
    for ids in (a, b):
        counts = [seen[int(i)] for i in ids]
        assert max(counts) - min(counts) <= 1
