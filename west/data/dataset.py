"""The training/eval data loader: IterableDataset + DataLoader.

Public entry point (what the trainer calls)::

    loader, dataset = build_dataloader(data_list: str, tokenizer, conf: DataConfig,
                                       rank=0, world_size=1, seed=0, epoch=0, training=True)
    for epoch in ...:
        dataset.set_epoch(epoch)
        for batch in loader:            # west.batch.Batch
            ...
            state = dataset.state_dict()  # save with the checkpoint (after the step)
        dataset.stats                     # DataStats of this rank's epoch (skips by category)
    # resume: dataset.load_state_dict(state); iterate loader -> rest of that epoch, identical.

Two modes, chosen by ``conf.plan`` (auto: planned when every record's length is
known from ``duration``/``num_frames`` metadata, never for tar shards):

* planned: the epoch is planned from lengths (``west.data.plan``) identically on
  every rank; rank r decodes only batch r of each step; every rank gets exactly
  ``len(dataset)`` batches; resume skips consumed batches without decoding.
* streamed: records (list lines or whole shards) are shuffled by (seed, epoch)
  and split disjointly over rank*worker; each worker runs shuffle buffer ->
  (sort buffer) -> batching. Ranks may get different batch counts: the trainer
  must stop all ranks together. Resume re-decodes the consumed batches.

Workers: logical worker l handles every W-th batch of its rank's stream, which
is exactly the DataLoader's round-robin order, so the batch sequence does not
depend on num_workers (planned mode) and resume can restart mid-round.
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import Iterator, Optional

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from west.batch import Batch
from west.data.batching import batch_samples, next_fit_rows, shuffle_buffer, sort_buffer
from west.data.collate import collate_packed, collate_padded, dummy_batch
from west.data.config import DataConfig
from west.data.features import GlobalCMVN
from west.data.lists import KaldiList, RawList, detect_data_type, iter_shard, read_shard_list
from west.data.metadata import LengthTable, token_budget
from west.data.plan import plan_epoch
from west.data.processors import DecodeContext, decode
from west.data.stats import DataStats
from west.data.tokenize import PromptEncoder

logger = logging.getLogger("west.data")


def _passthrough(item):
    return item


class SpeechDataset(IterableDataset):
    """Yields ``(logical_worker, Batch | None, stats_delta)``; use ``WestDataLoader``."""

    def __init__(self, data_list: str, tokenizer, conf: DataConfig, rank: int = 0, world_size: int = 1,
                 seed: int = 0, epoch: int = 0, training: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.conf, self.rank, self.world_size = conf, rank, world_size
        self.seed, self.epoch, self.training = seed, epoch, training
        self.encoder = PromptEncoder(tokenizer, conf)
        self.cmvn = GlobalCMVN.from_json(conf.cmvn) if conf.cmvn else None
        self.list_skips = DataStats(conf.max_warnings)   # parse/metadata skips, warned once here
        self.stats = DataStats(conf.max_warnings)        # this rank's epoch, merged from workers
        self.data_type = detect_data_type(data_list) if conf.data_type == "auto" else conf.data_type
        self.planned = False
        if self.data_type == "shard":
            if conf.plan == "always":
                raise ValueError("data config plan='always' needs lengths; tar shard lists are streamed")
            self.source = read_shard_list(data_list)
        else:
            table = LengthTable(self.encoder, conf, self.list_skips, required=conf.plan == "always")
            on_record = table.add if conf.plan != "never" else None
            self.source = KaldiList(data_list, self.list_skips, on_record) if self.data_type == "kaldi" \
                else RawList(data_list, self.list_skips, on_record)
            found = table.finish() if on_record is not None else None
            if found is not None:
                self.planned = True
                self.lengths, self.eligible = found
            elif on_record is not None:
                logger.info("streaming %s: no length for %s (run tools/compute_lengths.py to plan epochs)",
                            data_list, table.missing)
        self._plan_cache: tuple[int, list] = (-1, [])
        self._resume: Optional[dict] = None
        self._iter_state: Optional[dict] = None
        self._consumed: list[int] = []

    # -- plan -------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (read ``stats`` of the previous one before). A pending resume
        for another epoch is dropped; ``state_dict()`` then points at the new epoch's start."""
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None
        if epoch != self.epoch:
            self._consumed = []
            self.stats = DataStats(self.conf.max_warnings)
        self.epoch = epoch

    def rank_batches(self) -> list[list[int]]:
        """This rank's planned batches (record indices) for the current epoch."""
        if not self.planned:
            raise TypeError("streamed data has no plan")
        if self._plan_cache[0] != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch]) if self.training and self.conf.shuffle else None
            steps = plan_epoch(self.eligible, self.lengths, self.conf, self.world_size, rng)
            self._plan_cache = (self.epoch, [step[self.rank] for step in steps])
        return self._plan_cache[1]

    def __len__(self) -> int:
        return len(self.rank_batches())

    # -- resume -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this rank is in the epoch (batches handed to the trainer, per logical worker)."""
        return {"version": 1, "epoch": self.epoch, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "planned": self.planned, "fingerprint": self.conf.fingerprint(),
                "consumed": list(self._consumed), "stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "rank", "world_size", "planned"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"data state {key}={state.get(key)!r} does not match this loader ({getattr(self, key)!r})")
        if state.get("fingerprint") != self.conf.fingerprint():
            raise ValueError("data state was saved with a different data config (batching options changed)")
        if not self.planned and state["consumed"] and len(state["consumed"]) != self._n_workers():
            raise ValueError(f"data state num_workers={len(state['consumed'])} != {self._n_workers()}: a streamed "
                             "epoch can only resume with the same num_workers")
        self.epoch = state["epoch"]
        self._resume = {"epoch": state["epoch"], "consumed": list(state["consumed"]), "stats": state["stats"]}

    def _n_workers(self) -> int:
        return max(1, self.conf.num_workers)

    def start_epoch_iteration(self) -> None:
        """Main process, before workers start: fix the plan, skips and worker rotation."""
        w = self._n_workers()
        consumed = [0] * w
        self.stats = DataStats(self.conf.max_warnings)
        if self._resume is not None and self._resume["epoch"] == self.epoch:
            old = self._resume["consumed"] or [0]
            if self.planned:
                k = sum(old)
                consumed = [len(range(l, k, w)) for l in range(w)]
            else:
                consumed = list(old)
            self.stats.load_state_dict(self._resume["stats"])
        self._resume = None
        if self.planned:
            self.rank_batches()
        rotation = min(range(w), key=lambda l: (consumed[l], l))
        self._iter_state = {"epoch": self.epoch, "skip": list(consumed), "rotation": rotation}
        self._consumed = list(consumed)

    def note_consumed(self, logical_worker: int) -> None:
        self._consumed[logical_worker] += 1

    # -- iteration --------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        w, phys = (info.num_workers, info.id) if info is not None else (1, 0)
        state = self._iter_state
        if state is None or state["epoch"] != self.epoch or len(state["skip"]) != w:
            state = {"skip": [0] * w, "rotation": 0}
        logical = (phys + state["rotation"]) % w
        return self._worker_stream(logical, w, state["skip"][logical])

    def _context(self, stats: DataStats) -> DecodeContext:
        return DecodeContext(self.conf, self.encoder, stats, self.cmvn, self.training, self.seed, self.epoch,
                             max_len=token_budget(self.conf), filter_duration=not self.planned)

    def _worker_stream(self, logical: int, n_workers: int, skip: int) -> Iterator[tuple]:
        """One logical worker's batches, each with the skip counts since the previous one.
        On resume the first ``skip`` batches are passed over and their counts dropped
        (they are in the restored stats)."""
        stats = DataStats(self.conf.max_warnings)
        if self.rank == 0 and logical == 0:
            stats.add_counts(self.list_skips.counts)
        batches = (self._planned_batches if self.planned else self._streamed_batches)(logical, n_workers, skip, stats)
        produced = False
        for batch in batches:
            produced = True
            yield logical, batch, stats.take_delta()
        delta = stats.take_delta()
        if delta and not produced and not skip:   # a worker without batches still reports its skips
            yield logical, None, delta

    def _planned_batches(self, logical: int, n_workers: int, skip: int, stats: DataStats) -> Iterator[Batch]:
        if skip:
            stats.take_delta()
        ctx = self._context(stats)
        for idx in self.rank_batches()[logical::n_workers][skip:]:
            samples = list(decode((self.source.record(i) for i in idx), ctx))
            yield self._collate(samples, stats, planned=True)

    def _streamed_batches(self, logical: int, n_workers: int, skip: int, stats: DataStats) -> Iterator[Batch]:
        conf, shuffle = self.conf, self.training and self.conf.shuffle
        g, n_global = self.rank * n_workers + logical, self.world_size * n_workers
        n = len(self.source)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n) if shuffle else np.arange(n)
        mine = order[g::n_global]
        if self.data_type == "shard":
            records = itertools.chain.from_iterable(iter_shard(self.source[i], stats) for i in mine)
        else:
            records = (self.source.record(int(i)) for i in mine)
        samples = decode(records, self._context(stats))
        if shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, self.rank, logical, n_workers])
            samples = shuffle_buffer(samples, conf.shuffle_buffer, rng)
        if conf.batch_type == "dynamic":
            samples = sort_buffer(samples, conf.sort_buffer)
        groups = batch_samples(samples, conf.batch_type, conf.batch_size, conf.max_tokens_in_batch,
                               conf.pack_tokens, conf.pack_buffer, conf.pack_algorithm)
        for j, group in enumerate(groups):
            if j < skip:               # resume: decoded again, not collated, counts dropped
                if j == skip - 1:
                    stats.take_delta()
                continue
            yield self._collate(group, stats, planned=False)

    def _collate(self, samples: list[dict], stats: DataStats, planned: bool) -> Batch:
        c, pad = self.conf, self.encoder.pad_id
        if not samples:
            stats.event("dummy_batches")
            return self.dummy_batch()
        if c.batch_type != "pack":
            longest = max(s["length"] for s in samples)
            if planned and c.batch_type == "dynamic" and longest * len(samples) > c.max_tokens_in_batch:
                stats.event("plan_overflow", samples[0]["src"], "decoded lengths exceed the planned dynamic budget")
            return collate_padded(samples, pad, c.num_mel_bins)
        lengths = [s["length"] for s in samples]
        rows = [samples]
        if sum(lengths) > c.pack_tokens:
            stats.event("plan_overflow", samples[0]["src"],
                        f"decoded lengths {sum(lengths)} exceed pack_tokens; batch gets an extra row "
                        "(list durations are wrong: run tools/compute_lengths.py)")
            rows = [[samples[i] for i in b] for b in next_fit_rows(lengths, c.pack_tokens)]
        return collate_packed(rows, c.pack_tokens, pad, c.encoder_layout, c.num_mel_bins, c.pack_pad_multiple)

    def dummy_batch(self) -> Batch:
        c = self.conf
        return dummy_batch(self.encoder.pad_id, self.encoder.placeholder_id, c.num_mel_bins, c.subsampling_rate,
                           c.projector_stride, c.pack_tokens if c.batch_type == "pack" else None, c.encoder_layout,
                           c.pack_pad_multiple)


class WestDataLoader(DataLoader):
    """DataLoader that strips the worker tags, records consumption for resume and
    reports skipped input at the end of the epoch."""

    def __iter__(self) -> Iterator[Batch]:
        ds: SpeechDataset = self.dataset
        ds.start_epoch_iteration()
        for logical, batch, delta in super().__iter__():
            ds.stats.merge(delta)
            if batch is None:
                continue
            ds.note_consumed(logical)
            yield batch
        level = logging.WARNING if ds.stats.skipped else logging.INFO
        logger.log(level, ds.stats.summary(f"data epoch {ds.epoch} rank {ds.rank}"))


def build_dataloader(data_list: str, tokenizer, conf: DataConfig, rank: int = 0, world_size: int = 1,
                     seed: int = 0, epoch: int = 0, training: bool = True) -> tuple[WestDataLoader, SpeechDataset]:
    """Loader yielding ``west.batch.Batch`` for ``data_list`` (jsonl, shard list or Kaldi dir)."""
    dataset = SpeechDataset(data_list, tokenizer, conf, rank, world_size, seed, epoch, training)
    if conf.num_workers > 0:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # workers fork after the main process tokenized
    loader = WestDataLoader(dataset, batch_size=None, collate_fn=_passthrough, num_workers=conf.num_workers,
                            pin_memory=conf.pin_memory,
                            prefetch_factor=conf.prefetch_factor if conf.num_workers > 0 else None,
                            persistent_workers=False)
    return loader, dataset
