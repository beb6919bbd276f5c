"""One planned group of tokenized samples -> one packed row a Hugging Face model trains on.

Features are dicts with ``input_ids`` (and optionally ``labels``, unshifted as in Hugging Face,
and ``attention_mask``, whose zeros mark padding that is dropped). The row holds the samples in
the given order, ``position_ids`` restart per sample, the label at each sample's first token is
-100 (it would otherwise be predicted from the previous sample), and the boundaries go to the
model as ``cu_seq_lens_q/k`` + ``max_length_q/k`` (read by west's attention and by
flash_attention_2). No 2-D attention mask is returned: SDPA or eager attention would use it and
let samples see each other.
"""
from __future__ import annotations

from typing import Optional, Sequence

from west.models.hf_attention import packed_kwargs
from west.packing import IGNORE, layout


class PackedCollator:
    """``collate_fn`` for rows planned by :class:`west.hf.sampler.PackedBatchSampler`."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: Optional[int] = None, backend: str = "auto") -> None:
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a non-negative integer token id, got {pad_token_id!r}")
        self.pad_token_id, self.multiple, self.backend = pad_token_id, pad_to_multiple_of, backend

    def __call__(self, features: Sequence[dict]) -> dict:
        if not features:
            raise ValueError("PackedCollator got an empty batch")
        seqs, labels = [], []
        for i, f in enumerate(features):
            ids = [int(t) for t in f["input_ids"]]
            lab = [int(t) for t in f.get("labels", ids)]
            if len(lab) != len(ids):
                raise ValueError(f"feature {i}: {len(lab)} labels for {len(ids)} input_ids")
            mask = f.get("attention_mask")
            if mask is not None:
                keep = [bool(m) for m in mask]
                ids = [t for t, k in zip(ids, keep) if k]
                lab = [t for t, k in zip(lab, keep) if k]
            if not ids:
                raise ValueError(f"feature {i} has no tokens")
            seqs.append(ids)
            labels.append(lab)
        width = sum(len(s) for s in seqs)
        if self.multiple:
            width = -(-width // self.multiple) * self.multiple
        row = layout([list(range(len(seqs)))], seqs, labels, width, self.pad_token_id, IGNORE)
        return dict(input_ids=row.input_ids, labels=row.labels, position_ids=row.position_ids,
                    **packed_kwargs(row.cu_seqlens, row.max_seqlen, backend=self.backend, west_extras=False))
