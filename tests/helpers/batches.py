"""The two row layouts every hand-made Batch uses: padded (one sample per row) and packed (one
row, samples back to back, positions restarting, a pad segment to fill the row)."""
from __future__ import annotations

from typing import Sequence

import torch

from west.batch import IGNORE_INDEX


def padded_rows(seqs: Sequence[tuple[list[int], list[int]]], pad: int, extra_len: int = 0) -> dict:
    """input_ids, labels (already shifted), position_ids and attention_mask of right-padded rows."""
    L = max(len(ids) for ids, _ in seqs) + extra_len
    R = len(seqs)
    ids = torch.full((R, L), pad, dtype=torch.long)
    labels = torch.full((R, L), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((R, L), dtype=torch.long)
    for r, (x, y) in enumerate(seqs):
        ids[r, :len(x)], labels[r, :len(y)], mask[r, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    return dict(input_ids=ids, labels=labels, position_ids=torch.arange(L).repeat(R, 1), attention_mask=mask)


def packed_row(seqs: Sequence[tuple[list[int], list[int]]], pack_tokens: int, pad: int) -> dict:
    """input_ids, labels, position_ids, cu_seqlens and max_seqlen of one row of exactly
    ``pack_tokens``; the unused tail is a pad segment of its own."""
    ids, labels, pos, lens = [], [], [], []
    for x, y in seqs:
        ids += x
        labels += y
        pos += list(range(len(x)))
        lens.append(len(x))
    tail = pack_tokens - len(ids)
    assert tail >= 0, f"{len(ids)} tokens do not fit a row of {pack_tokens}"
    if tail:
        ids += [pad] * tail
        labels += [IGNORE_INDEX] * tail
        pos += list(range(tail))
        lens.append(tail)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return dict(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), position_ids=torch.tensor([pos]),
                cu_seqlens=cu, max_seqlen=max(lens))
