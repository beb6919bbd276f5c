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

from torch.utils.data import DataLoader
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


class PackingMixin:
    """Put before a ``Trainer`` subclass: ``class MyTrainer(PackingMixin, SFTTrainer)``.

    ``pack_length``: tokens per row (every sample must fit: a longer one is refused up front,
    naming its index); ``pad_token_id``: the filler id when rows are rounded up
    (``pad_to_multiple_of``); ``pack_cost``: what is balanced across ranks (``linear`` tokens,
    ``square`` Σlen², attention-heavy models)."""

    def __init__(self, *args, pack_length: int, pad_token_id: int, pad_to_multiple_of: Optional[int] = None,
                 pack_algorithm: str = "bfd", pack_cost: str = "linear", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pack_length, self.pack_algorithm, self.pack_cost = pack_length, pack_algorithm, pack_cost
        self.packed_collator = PackedCollator(pad_token_id, pad_to_multiple_of)
        self.packed_sampler: Optional[PackedBatchSampler] = None

    def get_train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset
        if dataset is None or "input_ids" not in getattr(dataset, "column_names", ["input_ids"]):
            raise ValueError("packing needs a train_dataset of tokenized samples with an input_ids column")
        lengths = [len(ids) for ids in dataset["input_ids"]] if hasattr(dataset, "column_names") \
            else [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
        self.packed_sampler = PackedBatchSampler(
            lengths, self.pack_length, world_size=self.args.world_size, rank=self.args.process_index,
            seed=self.args.seed, algorithm=self.pack_algorithm, cost=self.pack_cost)
        loader = DataLoader(dataset, batch_sampler=self.packed_sampler, collate_fn=self.packed_collator,
                            num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory)
        prepared = self.accelerator.prepare(loader)
        # The sampler is rank-aware already: accelerate's BatchSamplerShard would shard it again and
        # drop rows; make that wrapper a pass-through (as transformers does for its own rank-aware sampler).
        shard = getattr(prepared, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is self.packed_sampler:
            shard.num_processes, shard.process_index = 1, 0
        return prepared


class PackedTrainer(PackingMixin, Trainer):
    """``transformers.Trainer`` training on packed rows (see :class:`PackingMixin`)."""
