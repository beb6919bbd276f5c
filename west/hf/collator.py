"""One planned group of tokenized samples -> one packed row a Hugging Face model trains on.

Features are dicts with ``input_ids`` (and optionally ``labels``, unshifted as in Hugging Face,
and ``attention_mask``, whose zeros mark padding that is dropped). The row holds the samples in
the given order, ``position_ids`` restart per sample, the label at each sample's first token is
-100 (it would otherwise be predicted from the previous sample), and the boundaries go to the
model as ``cu_seq_lens_q/k`` + ``max_length_q/k`` (read by west's attention and by
flash_attention_2). No 2-D attention mask is returned: SDPA or eager attention would use it and
let samples see each other. Token ids must be non-negative integers (Python, numpy or torch);
anything else is refused, never coerced.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from west.models.hf_attention import packed_kwargs
from west.packing import IGNORE, layout


def _ids(values, what: str) -> list[int]:
    """Integer token ids as a list, refusing floats, bools and (for inputs) negative ids."""
    arr = np.asarray(values.detach().cpu() if hasattr(values, "detach") else values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{what} must be a 1-D sequence of integer token ids, got dtype {arr.dtype} "
                         f"with shape {arr.shape}")
    return arr.astype(np.int64).tolist()


class PackedCollator:
    """``collate_fn`` for rows planned by :class:`west.hf.sampler.PackedBatchSampler`.

    ``pad_token_id`` is needed only with ``pad_to_multiple_of`` (a row is otherwise exactly as
    wide as its tokens, so tokenizers without a pad token, such as Llama's, need none)."""

    def __init__(self, pad_token_id: Optional[int] = None, pad_to_multiple_of: Optional[int] = None) -> None:
        if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)
                                         or pad_token_id < 0):
            raise ValueError(f"pad_token_id must be a non-negative integer token id, got {pad_token_id!r}")
        if pad_to_multiple_of is not None and pad_token_id is None:
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} pads rows: it needs a pad_token_id")
        self.pad_token_id, self.multiple = pad_token_id, pad_to_multiple_of

    def __call__(self, features: Sequence[dict]) -> dict:
        if not features:
            raise ValueError("PackedCollator got an empty batch")
        seqs, labels = [], []
        for i, f in enumerate(features):
            ids = _ids(f["input_ids"], f"feature {i}: input_ids")
            if any(t < 0 for t in ids):
                raise ValueError(f"feature {i}: input_ids has a negative token id ({min(ids)})")
            lab = _ids(f["labels"], f"feature {i}: labels") if f.get("labels") is not None else list(ids)
            if len(lab) != len(ids):
                raise ValueError(f"feature {i}: {len(lab)} labels for {len(ids)} input_ids")
            mask = f.get("attention_mask")
            if mask is not None:
                keep = [bool(m) for m in mask]
                if len(keep) != len(ids):
                    raise ValueError(f"feature {i}: {len(keep)} attention_mask entries for {len(ids)} input_ids")
                ids = [t for t, k in zip(ids, keep) if k]
                lab = [t for t, k in zip(lab, keep) if k]
            if not ids:
                raise ValueError(f"feature {i} has no tokens")
            seqs.append(ids)
            labels.append(lab)
        width = sum(len(s) for s in seqs)
        if self.multiple:
            width = -(-width // self.multiple) * self.multiple
        pad = self.pad_token_id if self.pad_token_id is not None else 0   # unused: no padding without a multiple
        row = layout([list(range(len(seqs)))], seqs, labels, width, pad, IGNORE)
        return dict(input_ids=row.input_ids, labels=row.labels, position_ids=row.position_ids,
                    **packed_kwargs(row.cu_seqlens, row.max_seqlen, west_extras=False))
