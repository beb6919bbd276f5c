"""Packing as plain functions, for any token-level training (Hugging Face or not).

west's planner (:func:`pack`, the best-fit-decreasing bin packer every batch mode uses) and the
packed-row layout: samples back to back in rows of at most ``max_length`` tokens, positions
restarting per sample, ``cu_seqlens`` bounding every sample, never a truncated sequence::

    from west.packing import pack, pack_sequences, concatenate_and_pack

    bins = pack([len(s) for s in seqs], 2048)                  # list[list[int]]
    rows = pack_sequences(seqs, max_length=2048, pad_token_id=0)
    rows.input_ids, rows.labels, rows.position_ids, rows.cu_seqlens
    model(**rows.model_inputs())   # with attn_implementation="west_varlen" (west.hf.use_packed_attention)

Labels follow Hugging Face's causal-LM convention: unshifted, the model shifts them. In a packed
row the first token of a sample would be predicted from the previous sample's last token, so
its label is set to -100; unpacked, nothing predicts a sequence's first token either, so packed
and unpacked training see exactly the same targets.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from west.data.packing import ALGORITHMS, COSTS, pack  # noqa: F401  (the planner, re-exported)
from west.models.hf_attention import packed_kwargs

IGNORE = -100


@dataclass
class Packed:
    """Rows of packed samples and where each sample sits."""

    input_ids: torch.Tensor      # (R, W) int64, pad_token_id after the last sample of a row
    labels: torch.Tensor         # (R, W) int64, -100 at each sample's first token and on padding
    position_ids: torch.Tensor   # (R, W) int64, restarting at 0 for every sample (and the padding)
    cu_seqlens: torch.Tensor     # (S + 1,) int32 over the R*W tokens: every sample, then a row's padding
    max_seqlen: int              # the longest segment
    boundaries: list = field(default_factory=list)   # per row: [(input index, start, end), ...]

    @property
    def padding_share(self) -> float:
        """Pad tokens / all tokens of the rows."""
        used = sum(end - start for row in self.boundaries for _, start, end in row)
        return 1.0 - used / max(1, self.input_ids.numel())

    def model_inputs(self, backend: str = "auto") -> dict:
        """``model(**...)`` keyword arguments: ids, labels, positions and the sample boundaries
        west's attention (``west_varlen``) reads; flash_attention_2 reads the same names."""
        return dict(input_ids=self.input_ids, labels=self.labels, position_ids=self.position_ids,
                    **packed_kwargs(self.cu_seqlens, self.max_seqlen, backend=backend))


def _token_id(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer token id, got {value!r}")
    return int(value)


def _as_list(x, what: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{what} must be one-dimensional, got shape {tuple(x.shape)}")
        return x.tolist()
    return [int(t) for t in x]


def _check_lengths(seqs: Sequence[list[int]], max_length: int, name: str = "sequences") -> None:
    if not seqs:
        raise ValueError(f"no {name} to pack")
    for i, s in enumerate(seqs):
        if not s:
            raise ValueError(f"{name}[{i}] is empty" + (" (after dropping the positions its mask zeroes)"
                                                         if name == "inputs" else ""))
        if len(s) > max_length:
            raise ValueError(f"{name}[{i}] has {len(s)} tokens, more than max_length {max_length}: "
                             "west never truncates; drop or split it first")


def layout(rows: Sequence[Sequence[int]], seqs: Sequence[list[int]], labels: Sequence[list[int]],
           width: int, pad_token_id: int, label_pad_id: int = IGNORE) -> Packed:
    """The packed layout of ``rows`` (input indices per row, in order) at ``width`` tokens per row."""
    n_rows = len(rows)
    ids = torch.full((n_rows, width), pad_token_id, dtype=torch.long)
    lab = torch.full((n_rows, width), label_pad_id, dtype=torch.long)
    pos = torch.zeros((n_rows, width), dtype=torch.long)
    cu, bounds = [0], []
    for r, members in enumerate(rows):
        start, row = 0, []
        for i in members:
            n = len(seqs[i])
            if start + n > width:
                raise ValueError(f"row {r}: sequences {list(members)} hold more than {width} tokens")
            ids[r, start:start + n] = torch.tensor(seqs[i], dtype=torch.long)
            lab[r, start + 1:start + n] = torch.tensor(labels[i][1:], dtype=torch.long)
            pos[r, start:start + n] = torch.arange(n)
            row.append((int(i), start, start + n))
            start += n
            cu.append(r * width + start)
        if start < width:   # the row's padding is a segment of its own, positions restarting
            pos[r, start:] = torch.arange(width - start)
            cu.append((r + 1) * width)
        bounds.append(row)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    return Packed(ids, lab, pos, cu_t, int(torch.diff(cu_t).max()), bounds)


def pack_sequences(sequences: Sequence, max_length: int, pad_token_id: int, return_boundaries: bool = False,
                   *, labels: Optional[Sequence] = None, algorithm: str = "bfd"):
    """Pack token sequences into as few rows of ``max_length`` tokens as west's planner finds.

    ``labels`` (default: the tokens themselves) are per-sequence, unshifted. A sequence longer
    than ``max_length`` or empty raises ValueError naming its index. Returns :class:`Packed`, or
    ``(Packed, boundaries)`` with ``return_boundaries`` (per row: (input index, start, end))."""
    pad = _token_id("pad_token_id", pad_token_id)
    seqs = [_as_list(s, f"sequences[{i}]") for i, s in enumerate(sequences)]
    _check_lengths(seqs, max_length)
    labs = _labels(labels, seqs)
    rows = pack([len(s) for s in seqs], max_length, algorithm=algorithm)
    packed = layout(rows, seqs, labs, max_length, pad)
    return (packed, packed.boundaries) if return_boundaries else packed


def concatenate_and_pack(inputs: Sequence, labels: Optional[Sequence] = None, masks: Optional[Sequence] = None,
                         *, max_length: int, pad_token_id: int, label_pad_id: int = IGNORE,
                         algorithm: str = "bfd") -> Packed:
    """Pack (input ids, labels, attention mask) triples: the positions a mask zeroes (padding
    already in the data) are dropped first, then the samples are packed as by
    :func:`pack_sequences`, padding labelled ``label_pad_id``."""
    pad = _token_id("pad_token_id", pad_token_id)
    seqs = [_as_list(s, f"inputs[{i}]") for i, s in enumerate(inputs)]
    labs = _labels(labels, seqs, "inputs")
    if masks is not None:
        if len(masks) != len(seqs):
            raise ValueError(f"got {len(masks)} masks for {len(seqs)} inputs")
        keep = [[bool(m) for m in _as_list(mask, f"masks[{i}]")] for i, mask in enumerate(masks)]
        for i, (s, k) in enumerate(zip(seqs, keep)):
            if len(k) != len(s):
                raise ValueError(f"masks[{i}] has {len(k)} entries but inputs[{i}] has {len(s)} tokens")
        seqs = [[t for t, k in zip(s, ks) if k] for s, ks in zip(seqs, keep)]
        labs = [[t for t, k in zip(lb, ks) if k] for lb, ks in zip(labs, keep)]
    _check_lengths(seqs, max_length, "inputs")
    rows = pack([len(s) for s in seqs], max_length, algorithm=algorithm)
    return layout(rows, seqs, labs, max_length, pad, int(label_pad_id))


def _labels(labels: Optional[Sequence], seqs: list[list[int]], name: str = "sequences") -> list[list[int]]:
    if labels is None:
        return seqs
    if len(labels) != len(seqs):
        raise ValueError(f"got {len(labels)} label sequences for {len(seqs)} {name}")
    out = [_as_list(lb, f"labels[{i}]") for i, lb in enumerate(labels)]
    for i, (s, lb) in enumerate(zip(seqs, out)):
        if len(s) != len(lb):
            raise ValueError(f"labels[{i}] has {len(lb)} tokens but {name}[{i}] has {len(s)}")
    return out
