"""Packed training with ``transformers.Trainer`` (and TRL's ``SFTTrainer``, same mixin).

``PackingMixin`` replaces the train dataloader: rows planned by :class:`PackedBatchSampler`
over the dataset's ``input_ids`` lengths (this rank's share, balanced across ranks, shuffled by
``args.seed`` and the epoch) and laid out by :class:`PackedCollator`. The loss stays one
per-token mean over a step: Trainer counts ``labels[..., 1:] != -100`` over the accumulated
micro-batches (``num_items_in_batch``), and a packed row masks exactly the positions an unpacked
batch never predicts (each sample's first token), so packed and unpacked runs count the same
tokens. ``use_packed_attention`` makes the model attend per sample (west_varlen: segment SDPA on
a CPU, flash / torch varlen / flex kernels on a GPU).
"""
from __future__ import annotations

from typing import Optional

from torch.utils.data import DataLoader, Dataset, IterableDataset
from transformers import Trainer

from west.hf.collator import PackedCollator
from west.hf.sampler import PackedBatchSampler
from west.hf.support import check_packable
from west.models.hf_attention import register


def use_packed_attention(model):
    """Check that west computes ``model``'s attention exactly on packed rows (``ValueError`` naming
    the setting otherwise, before any data is read), register west's attention with transformers
    and switch ``model`` to it; returns the model. Unpacked batches (no ``cu_seq_lens_q``) still
    run transformers' own attention and mask."""
    check_packable(model)
    name = register()
    model.set_attn_implementation(name)
    return model


class DummyAwareDataset(Dataset):
    """The train dataset as the packed sampler reads it: index ``-1 - i`` is sample ``i`` with
    every label -100, the row a rank computes where the plan left it none (it adds nothing)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        if i >= 0:
            return self.dataset[i]
        feature = dict(self.dataset[-1 - i])
        feature["labels"] = [-100] * len(feature["input_ids"])
        return feature


class PackingMixin:
    """Put before a ``Trainer`` subclass: ``class MyTrainer(PackingMixin, SFTTrainer)``.

    ``pack_length``: tokens per row (every sample must fit: a longer one is refused up front,
    naming its index); ``pad_token_id``: the filler id, needed only to round rows up
    (``pad_to_multiple_of``); ``pack_cost``: what is balanced across ranks (``linear`` tokens,
    ``square`` Σlen², attention-heavy models). Refused when the trainer is built, before any
    data is read: TRL's own packing (``packing=True``, or a ``seq_lengths`` / ``position_ids``
    column: the rows would be packed twice and attend across samples), TRL's truncation
    (``max_length`` set: long samples would be cut before west sees them), and a streaming
    dataset (the plan needs every length up front)."""

    def __init__(self, *args, pack_length: int, pad_token_id: Optional[int] = None,
                 pad_to_multiple_of: Optional[int] = None, pack_algorithm: str = "bfd", pack_cost: str = "linear",
                 **kwargs) -> None:
        _refuse_trl_packing(kwargs["args"] if "args" in kwargs else args[1] if len(args) > 1 else None)
        super().__init__(*args, **kwargs)
        _refuse_dataset(self.train_dataset)
        self.pack_length, self.pack_algorithm, self.pack_cost = pack_length, pack_algorithm, pack_cost
        self.packed_collator = PackedCollator(pad_token_id, pad_to_multiple_of)
        self.packed_sampler: Optional[PackedBatchSampler] = None

    def get_train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset
        _refuse_dataset(dataset)
        lengths = [len(ids) for ids in dataset["input_ids"]] if hasattr(dataset, "column_names") \
            else [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
        self.packed_sampler = PackedBatchSampler(
            lengths, self.pack_length, world_size=self.args.world_size, rank=self.args.process_index,
            seed=self.args.seed, algorithm=self.pack_algorithm, cost=self.pack_cost, empty_rows="dummy")
        dummies = sum(row[0] < 0 for row in self.packed_sampler.rows(0))
        if dummies and not getattr(self.args, "average_tokens_across_devices", True):
            raise ValueError(f"rank {self.args.process_index} has {dummies} row(s) without samples (the plan of "
                             f"{len(lengths)} samples leaves it none in those steps): with "
                             "average_tokens_across_devices=False its loss would divide by zero tokens; set it True")
        loader = DataLoader(DummyAwareDataset(dataset), batch_sampler=self.packed_sampler,
                            collate_fn=self.packed_collator, num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory)
        prepared = self.accelerator.prepare(loader)
        # The sampler is rank-aware already: accelerate's BatchSamplerShard would shard it again and
        # drop rows; make that wrapper a pass-through (as transformers does for its own rank-aware sampler).
        shard = getattr(prepared, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is self.packed_sampler:
            shard.num_processes, shard.process_index = 1, 0
        return prepared


def _refuse_trl_packing(args) -> None:
    """TRL's packing or truncation in the training arguments: refused before TRL touches the data."""
    if getattr(args, "packing", False):
        raise ValueError("args.packing=True: TRL would pack the samples first and west would treat each TRL row as "
                         "one sample, so attention would cross samples; set packing=False (west packs)")
    for name in ("max_length", "max_seq_length"):
        if hasattr(args, "packing") and getattr(args, name, None) is not None:
            raise ValueError(f"args.{name}={getattr(args, name)}: TRL truncates every longer sample before west "
                             f"sees it; set {name}=None (west refuses a sample longer than pack_length instead "
                             "of cutting it)")


def _refuse_dataset(dataset) -> None:
    if dataset is None:
        raise ValueError("packing needs a train_dataset of tokenized samples with an input_ids column")
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(f"train_dataset is a streaming (iterable) {type(dataset).__name__}: west plans each "
                         "epoch's rows from every sample's length up front; load a map-style dataset")
    columns = getattr(dataset, "column_names", None) or []
    if columns and "input_ids" not in columns:
        raise ValueError(f"packing needs an input_ids column; the train_dataset has {columns}")
    packed = [c for c in ("seq_lengths", "position_ids", "cu_seq_lens_q") if c in columns]
    if packed:
        raise ValueError(f"train_dataset has column(s) {packed}: its rows are packed already (TRL packing?); "
                         "give west the unpacked tokenized samples")


class PackedTrainer(PackingMixin, Trainer):
    """``transformers.Trainer`` training on packed rows (see :class:`PackingMixin`)."""
