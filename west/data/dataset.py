"""The training data loader: one pipeline from list lines to batches.

    lists ──open_list + LengthTable──▶ lengths, usable records (filters, skips counted per list)
          ──epoch_order (weights, seed, epoch)──▶ ──plan_epoch (policy, world size, windows)──▶ steps
          ──this rank's batches──▶ decode (audio, fbank, CMVN, SpecAugment, tokens) ──policy.collate──▶ Batch

Public entry point (what the trainer calls)::

    loader, dataset = build_dataloader(lists, tokenizer, conf, shape, rank, world_size, seed, epoch)
    dataset.set_epoch(epoch)
    for batch in loader: ...           # west.batch.Batch; len(dataset) batches per epoch on every rank
    state = dataset.state_dict()       # after a step; load_state_dict(state) resumes right after it

Every epoch is planned from lengths, identically on every rank: rank r decodes
only its own batches, every rank gets exactly ``len(dataset)`` batches, and a
resume skips the consumed batches without decoding them. Loader workers split
this rank's remaining batches round robin, which is the DataLoader's own order,
so the batches do not depend on ``num_workers``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from west.batch import Batch
from west.data.config import DataConfig, for_shape
from west.data.features import GlobalCMVN
from west.data.lengths import LengthTable
from west.data.lists import open_list
from west.data.plan import EpochPlan, epoch_order, plan_epoch
from west.data.policies import make_policy
from west.data.processors import DecodeContext, decode
from west.data.stats import DataStats
from west.data.tokenize import PromptEncoder
from west.shapes import PackExtent, SpeechShape

logger = logging.getLogger("west.data")

# Options that decide which samples form which batch: a resume must not change them.
BATCHING_KEYS = ("batch_type", "batch_size", "max_tokens_in_batch", "pack_tokens", "pack_algorithm", "pack_cost",
                 "plan_window", "weights", "data_type", "shuffle", "sort_buffer", "min_duration", "max_duration",
                 "sample_rate", "frame_length_ms", "frame_shift_ms", "prompt", "system_prompt")
COLUMN_KEYS = ("audio_column", "text_column", "duration_column", "key_column", "messages_column")


def _passthrough(item):
    return item


class SpeechDataset(IterableDataset):
    """Yields ``(Batch, stats_delta)``; use ``WestDataLoader``."""

    def __init__(self, data_lists: str | Sequence[str], tokenizer, conf: DataConfig, shape: SpeechShape,
                 rank: int = 0, world_size: int = 1, seed: int = 0, epoch: int = 0, training: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        paths = [p for p in data_lists.split(",") if p] if isinstance(data_lists, str) else list(data_lists)
        if conf.weights is not None and len(conf.weights) != len(paths):
            raise ValueError(f"data.weights: {len(conf.weights)} weight(s) for {len(paths)} list(s)")
        conf = for_shape(conf, shape)
        self.conf, self.shape, self.rank, self.world_size = conf, shape, rank, world_size
        self.seed, self.epoch, self.training = seed, epoch, training
        self.encoder = PromptEncoder(tokenizer, conf, shape)
        self.policy = make_policy(conf, self.encoder.pad_id, self.encoder.placeholder_id, shape, self.encoder.prefix)
        if self.encoder.prefix and rank == 0 and training:
            logger.info("data.shared_prefix: the prompt's first %d tokens, %r, laid out once per pack row",
                        len(self.encoder.prefix), tokenizer.decode(self.encoder.prefix))
        self.cmvn = GlobalCMVN.from_json(conf.cmvn) if conf.cmvn else None
        self.sources, self.list_skips, eligible, tables = [], [], [], []
        offset = 0
        for path in paths:
            stats = DataStats(conf.max_warnings)
            table = LengthTable(self.encoder, conf, stats, self.policy.sample_budget(), path)
            self.sources.append(open_list(path, stats, conf.data_type, table.add, conf))
            tables.append(table.finish())
            self.list_skips.append((path, stats))
            eligible.append(tables[-1].usable + offset)
            offset += tables[-1].lengths.shape[0]
        self.offsets = np.cumsum([0] + [len(s) for s in self.sources])

        def joined(field: str) -> np.ndarray:
            return np.concatenate([getattr(t, field) for t in tables]) if tables else np.zeros(0, np.int64)

        self.lengths, self.encoder_frames = joined("lengths"), joined("encoder_frames")
        self.audio_parts, self.longest_part = joined("audio_parts"), joined("longest_part")
        self.eligible = eligible
        self.fingerprint = _fingerprint(conf, shape, paths)
        for path, stats in self.list_skips:
            if stats.skipped:
                logger.warning(stats.summary(f"list {path}"))
        self.stats = DataStats(conf.max_warnings)   # this rank's epoch, merged from workers
        self.warn_limit = conf.max_warnings           # per pass; a dev set repeats its warnings only once
        self._plan: tuple[int, Optional[EpochPlan], list] = (-1, None, [])
        self._resume: Optional[dict] = None
        self._consumed = 0
        self._skip = 0

    # -- plan -------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (read ``stats`` of the previous one before). A pending resume
        for another epoch is dropped; ``state_dict()`` then points at the new epoch's start."""
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None
        if epoch != self.epoch:
            self._consumed = 0
            self.stats = DataStats(self.conf.max_warnings)
        self.epoch = epoch

    def plan(self) -> EpochPlan:
        """The whole epoch's plan (all ranks), computed once per epoch."""
        if self._plan[0] != self.epoch:
            shuffle = self.training and self.conf.shuffle
            order = epoch_order(self.eligible, self.conf.weights, self.seed, self.epoch, shuffle)
            rng = np.random.default_rng([self.seed, self.epoch, 1]) if shuffle else None
            plan = plan_epoch(order, self.lengths, self.policy, self.world_size, self.conf.plan_window, rng)
            self._plan = (self.epoch, plan, plan.rank_batches(self.rank))
        return self._plan[1]

    def rank_batches(self) -> list[np.ndarray]:
        """This rank's batches (global record ids) for the current epoch."""
        self.plan()
        return self._plan[2]

    def __len__(self) -> int:
        return len(self.rank_batches())

    def pack_extent(self) -> PackExtent:
        """What the fullest of this rank's batches in the current epoch's plan hold in the encoder
        (frames, speech segments, the longest segment): the shape a fixed-shape encoder must take."""
        batches = self.rank_batches()
        return PackExtent(max((int(self.encoder_frames[ids].sum()) for ids in batches), default=0),
                          max((int(self.audio_parts[ids].sum()) for ids in batches), default=0),
                          max((int(self.longest_part[ids].max()) for ids in batches if len(ids)), default=0))

    def record(self, gid: int) -> dict:
        """The record with global id ``gid`` (lists are numbered one after the other)."""
        i = int(np.searchsorted(self.offsets, gid, side="right")) - 1
        return self.sources[i].record(int(gid - self.offsets[i]))

    # -- resume -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this rank is in the epoch: batches handed to the trainer, and the skip counts."""
        return {"version": 2, "epoch": self.epoch, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "fingerprint": self.fingerprint,
                "consumed": self._consumed, "stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for key in ("version", "seed", "rank", "world_size"):
            mine = 2 if key == "version" else getattr(self, key)
            if state.get(key) != mine:
                raise ValueError(f"data state {key}={state.get(key)!r} does not match this loader ({mine!r})")
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError("data state was saved with other data lists or batching options "
                             "(batch type, sizes, weights, filters or model geometry changed)")
        self.epoch = state["epoch"]
        self._resume = {"epoch": state["epoch"], "consumed": int(state["consumed"]), "stats": state["stats"]}

    def start_epoch_iteration(self) -> None:
        """Main process, before workers start: fix the plan and the resume position."""
        self.stats = DataStats(self.conf.max_warnings)
        skip = 0
        if self._resume is not None and self._resume["epoch"] == self.epoch:
            skip = self._resume["consumed"]
            self.stats.load_state_dict(self._resume["stats"])
        self._resume = None
        self.rank_batches()
        self._consumed = self._skip = skip

    def note_consumed(self) -> None:
        self._consumed += 1

    # -- iteration --------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        stats = DataStats(self.warn_limit)
        if self.rank == 0 and worker == 0 and self._skip == 0:   # list skips, reported once per epoch
            for _, list_stats in self.list_skips:
                stats.add_counts(list_stats.counts)
        ctx = DecodeContext(self.conf, self.encoder, stats, self.cmvn, self.training, self.seed, self.epoch,
                            budget=self.policy.sample_budget())
        produced = False
        for ids in self.rank_batches()[self._skip:][worker::n_workers]:
            samples = list(decode((self.record(int(i)) for i in ids), ctx))
            batch = self.policy.collate(samples, stats)
            produced = True
            yield batch, stats.take_delta()
        delta = stats.take_delta()
        if delta and not produced:   # a worker without batches still reports its skips
            yield None, delta

    def dummy_batch(self) -> Batch:
        return self.policy.dummy_batch()


def _fingerprint(conf: DataConfig, shape: SpeechShape, paths: list[str]) -> str:
    keep = {k: getattr(conf, k) for k in BATCHING_KEYS}
    geometry = [shape.subsampling_rate, shape.projector_stride]
    if shape.frame_stages is not None:   # (an encoder with Conv2d subsampling keeps the fingerprint it had)
        geometry += [shape.encoder_type, shape.max_frames, conf.features]
    keep.update(shape=geometry, lists=[os.path.abspath(p) for p in paths])
    if conf.shared_prefix:   # plans rows without each sample's prefix (off: the fingerprint it had)
        keep["shared_prefix"] = True
    for key in COLUMN_KEYS:   # a dataset's columns, where not the defaults (which keep the fingerprint it had)
        if getattr(conf, key) != getattr(DataConfig, key):
            keep[key] = getattr(conf, key)
    return hashlib.sha1(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


class WestDataLoader(DataLoader):
    """The one object the trainer reads data through (west.train.data_interface.TrainData): this rank's
    batches of the epoch, where it is in them (``state_dict``), what it skipped, and the dummy
    batch it computes when it has none left. It records consumption for resume and reports
    skipped input at the end of the epoch; its ``dataset`` plans and decodes."""

    dataset: SpeechDataset

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)  # every epoch is planned: known before it is read

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)

    def skipped_counts(self) -> dict:
        return self.dataset.stats.as_dict()

    def pack_extent(self) -> PackExtent:
        return self.dataset.pack_extent()

    def dummy_batch(self) -> Batch:
        return self.dataset.dummy_batch()

    def __iter__(self) -> Iterator[Batch]:
        ds: SpeechDataset = self.dataset
        ds.start_epoch_iteration()
        for batch, delta in super().__iter__():
            ds.stats.merge(delta)
            if batch is None:
                continue
            ds.note_consumed()
            yield batch
        if ds.stats.skipped or ds.training:   # a dev pass reports only what it skipped
            level = logging.WARNING if ds.stats.skipped else logging.INFO
            logger.log(level, ds.stats.summary(f"data epoch {ds.epoch} rank {ds.rank}" if ds.training
                                               else f"dev list rank {ds.rank}"))


def build_dataloader(data_lists: str | Sequence[str], tokenizer, conf: DataConfig, shape: SpeechShape,
                     rank: int = 0, world_size: int = 1, seed: int = 0, epoch: int = 0,
                     training: bool = True) -> tuple[WestDataLoader, SpeechDataset]:
    """Loader yielding ``west.batch.Batch`` for one or several lists (any kind of west.data.lists)."""
    dataset = SpeechDataset(data_lists, tokenizer, conf, shape, rank, world_size, seed, epoch, training)
    if conf.num_workers > 0:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # workers fork after the main process tokenized
    loader = WestDataLoader(dataset, batch_size=None, collate_fn=_passthrough, num_workers=conf.num_workers,
                            pin_memory=conf.pin_memory,
                            prefetch_factor=conf.prefetch_factor if conf.num_workers > 0 else None,
                            persistent_workers=False)
    # Every new iterator draws its workers' base seed from the GLOBAL torch RNG unless the loader
    # has a generator: a resumed run would start at another point of that stream than the
    # uninterrupted run did and shift every later dropout mask. The pipeline itself seeds from
    # (seed, epoch, key).
    loader.generator = torch.Generator().manual_seed(seed)
    return loader, dataset
