"""Batching policies: the one place where static, dynamic and pack differ.

A policy answers four questions for its mode:

* what a sample may cost: ``sample_budget()``, the most LLM tokens one sample
  may have (longer samples are counted as ``too_long`` and skipped, never cut);
* how an ordered window of samples becomes batches: ``group(lengths,
  world_size, rng)`` returns window positions batch after batch plus the batch
  sizes; consecutive ``world_size`` batches form one step (one batch per rank);
* how a batch is collated: ``collate(samples, stats)``;
* what a rank trains on when it has nothing: ``dummy_batch()``.

A new mode is one new class here and one entry in ``POLICIES``.
"""
from __future__ import annotations

from typing import ClassVar, Optional

import numpy as np

from west.batch import Batch
from west.data.batching import dynamic_sizes, equalize_rounds, sort_in_windows, split_rows, static_sizes
from west.data.collate import collate_packed, collate_padded, dummy_sample
from west.data.config import DataConfig
from west.data.packing import pack_slots
from west.data.stats import DataStats
from west.shapes import SpeechShape


class BatchPolicy:
    """Base: padded collation, no per-sample budget."""

    size_key: ClassVar[str]   # the DataConfig key that sizes this mode's batches

    def __init__(self, conf: DataConfig, pad_id: int, placeholder_id: int, shape: SpeechShape):
        self.conf, self.pad_id, self.placeholder_id, self.shape = conf, pad_id, placeholder_id, shape

    def sample_budget(self) -> Optional[int]:
        return None

    def group(self, lengths: np.ndarray, world_size: int,
              rng: Optional[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def collate(self, samples: list[dict], stats: DataStats) -> Batch:
        if not samples:
            stats.event("dummy_batches")
            return self.dummy_batch()
        return collate_padded(samples, self.pad_id, self.conf.num_mel_bins)

    def dummy_batch(self) -> Batch:
        return self._finish_dummy(collate_padded([self._dummy()], self.pad_id, self.conf.num_mel_bins))

    def _dummy(self) -> dict:
        return dummy_sample(self.pad_id, self.placeholder_id, self.conf.num_mel_bins, self.shape)

    @staticmethod
    def _finish_dummy(batch: Batch) -> Batch:
        batch.keys = []
        batch.counters = {k: 0 for k in batch.counters}
        return batch


class StaticPolicy(BatchPolicy):
    """``batch_size`` samples per batch, every row padded to the longest."""

    size_key = "batch_size"

    def group(self, lengths, world_size, rng):
        sizes = equalize_rounds(static_sizes(lengths.shape[0], self.conf.batch_size), world_size)
        return np.arange(lengths.shape[0]), sizes


class DynamicPolicy(BatchPolicy):
    """As many samples as fit ``max_tokens_in_batch`` counting padding, from sort windows."""

    size_key = "max_tokens_in_batch"

    def sample_budget(self) -> Optional[int]:
        return self.conf.max_tokens_in_batch

    def group(self, lengths, world_size, rng):
        # sorted windows give batches of similar lengths, and neighbouring batches (one
        # step) similar costs; the planner then shuffles the steps
        order = sort_in_windows(lengths, self.conf.sort_buffer)
        sizes = dynamic_sizes(lengths[order], self.conf.max_tokens_in_batch)
        return order, equalize_rounds(sizes, world_size)

    def collate(self, samples, stats):
        if samples and max(s["length"] for s in samples) * len(samples) > self.conf.max_tokens_in_batch:
            stats.event("plan_overflow", samples[0]["src"], "decoded lengths exceed the planned dynamic budget")
        return super().collate(samples, stats)


class PackPolicy(BatchPolicy):
    """Rows of at most ``pack_tokens`` by bin packing, balanced over the ranks of a step."""

    size_key = "pack_tokens"

    def sample_budget(self) -> Optional[int]:
        return self.conf.pack_tokens

    def group(self, lengths, world_size, rng):
        c = self.conf
        slot, n_bins = pack_slots(lengths, c.pack_tokens, c.pack_algorithm, world_size, c.pack_cost)
        order = np.argsort(slot, kind="stable")
        sizes = np.bincount(slot, minlength=n_bins).astype(np.int64)
        return _fill_empty_packs(order, sizes, world_size)

    def collate(self, samples, stats):
        if not samples:
            stats.event("dummy_batches")
            return self.dummy_batch()
        lengths = [s["length"] for s in samples]
        rows = [samples]
        if sum(lengths) > self.conf.pack_tokens:
            stats.event("plan_overflow", samples[0]["src"],
                        f"decoded lengths {sum(lengths)} exceed pack_tokens; batch gets an extra row "
                        "(list durations are wrong: run tools/compute_lengths.py)")
            rows = [[samples[i] for i in b] for b in split_rows(lengths, self.conf.pack_tokens)]
        return self._collate_rows(rows)

    def dummy_batch(self) -> Batch:
        return self._finish_dummy(self._collate_rows([[self._dummy()]]))

    def _collate_rows(self, rows: list[list[dict]]) -> Batch:
        c = self.conf
        return collate_packed(rows, c.pack_tokens, self.pad_id, c.encoder_layout, c.num_mel_bins,
                              c.pack_pad_multiple)


def _fill_empty_packs(order: np.ndarray, sizes: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Give an empty pack one sample of the pack with the most samples (prefer its own step).
    Only tiny windows (fewer samples than ranks in a step) have empty packs."""
    if sizes.all() or world_size == 1:
        return order, sizes
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    packs = [list(order[bounds[b]:bounds[b + 1]]) for b in range(sizes.shape[0])]
    for s in range(0, len(packs), world_size):
        step = packs[s:s + world_size]
        for b, members in enumerate(step):
            if members:
                continue
            local = max(step, key=len)
            donor = local if len(local) >= 2 else max(packs, key=len)
            if len(donor) >= 2:
                step[b].append(donor.pop())
    flat = [i for p in packs for i in p]
    return np.asarray(flat, np.int64), np.asarray([len(p) for p in packs], np.int64)


POLICIES: dict[str, type[BatchPolicy]] = {"static": StaticPolicy, "dynamic": DynamicPolicy, "pack": PackPolicy}


def make_policy(conf: DataConfig, pad_id: int, placeholder_id: int, shape: SpeechShape) -> BatchPolicy:
    """The policy of ``conf.batch_type``."""
    if conf.batch_type not in POLICIES:
        raise ValueError(f"data.batch_type: must be one of {sorted(POLICIES)}, got {conf.batch_type!r}")
    return POLICIES[conf.batch_type](conf, pad_id, placeholder_id, shape)
