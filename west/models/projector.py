"""Encoder frames -> LLM embeddings.

Each utterance's frames are grouped ``stride`` at a time on their own, the last
partial group zero-filled (never dropped, never borrowed from the next
utterance), so an utterance of n encoder frames yields
``west.shapes.projected_frames(n, stride)`` embeddings: the count the data
pipeline reserved as placeholder slots. Two projectors share that grouping:

* :class:`Projector` (``type: mlp``): stack the group's frames, then an MLP
  (:class:`LinearProjector`, ``type: linear``: one Linear instead);
* :class:`PosteriorProjector` (``type: ctc_posterior``): the CTC head's posterior
  over the LLM vocabulary (+ blank) times the LLM's own input embeddings,
  averaged over the group. Speech then enters the LLM as "soft tokens" in the
  space it was pretrained on, which a small or frozen LLM reads far sooner
  than an MLP's output (the idea of LegoSLM, Ma et al., 2025);
* :class:`CompactPosteriorProjector` (``type: ctc_compact``): the same soft
  tokens, one per greedy CTC segment (blank frames dropped, repeats merged, as
  in CTC compression, Gaido et al., 2021), moved to the front of the
  utterance's slots; the rest of the slots hold the blank's embedding. The
  LLM then copies a contiguous run instead of finding tokens between blanks.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from west.batch import to_device
from west.models.config import ProjectorConfig
from west.shapes import projected_frames


def group_frames(x: torch.Tensor, lengths: Sequence[int], stride: int) -> torch.Tensor:
    """(Σ n, D) utterances end to end -> (Σ ceil(n/stride), stride, D), zero-filled per utterance."""
    lengths = [int(n) for n in lengths]
    if sum(lengths) != x.shape[0]:
        raise ValueError(f"lengths cover {sum(lengths)} frames, x has {x.shape[0]}")
    s = stride
    slots = [-(-n // s) * s for n in lengths]
    if sum(slots) != x.shape[0]:  # some utterance needs zero fill
        seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
        offsets = torch.tensor([0] + slots[:-1]).cumsum(0)
        dst = to_device(torch.arange(x.shape[0]) - starts[seg] + offsets[seg], x.device)
        x = x.new_zeros(sum(slots), x.shape[1]).index_copy(0, dst, x)
    return x.view(-1, s, x.shape[1])


class Projector(nn.Module):
    def __init__(self, input_dim: int, output_dim: int, cfg: ProjectorConfig):
        super().__init__()
        self.stride = cfg.stride
        self.net = nn.Sequential(
            nn.Linear(input_dim * cfg.stride, cfg.hidden_dim),
            nn.GELU(),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden_dim, output_dim),
        )

    def output_lengths(self, lengths: Sequence[int]) -> list[int]:
        return [projected_frames(n, self.stride) for n in lengths]

    def forward(self, x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """x (Σ n, D) utterances end to end -> (Σ ceil(n/stride), H) in the same order."""
        g = group_frames(x, lengths, self.stride)
        return self.net(g.reshape(g.shape[0], -1))


class LinearProjector(Projector):
    """``type: linear``: the group's stacked frames through one Linear (no hidden layer): a released
    model's projector, e.g. Qwen2-Audio's ``multi_modal_projector.linear`` at stride 1."""

    def __init__(self, input_dim: int, output_dim: int, cfg: ProjectorConfig):
        nn.Module.__init__(self)
        self.stride = cfg.stride
        self.net = nn.Linear(input_dim * cfg.stride, output_dim)


class PosteriorProjector(nn.Module):
    """CTC logits (Σ n, C) -> mean over each group of softmax(logits) @ ``table`` (C, H)."""

    def __init__(self, cfg: ProjectorConfig):
        super().__init__()
        self.stride = cfg.stride

    def output_lengths(self, lengths: Sequence[int]) -> list[int]:
        return [projected_frames(n, self.stride) for n in lengths]

    def forward(self, logits: torch.Tensor, lengths: Sequence[int], table: torch.Tensor) -> torch.Tensor:
        soft = F.softmax(logits.float(), dim=-1).to(table.dtype) @ table          # (Σ n, H)
        # the same grouping over a column of ones counts the real frames of every group
        real = group_frames(soft.new_ones(soft.shape[0], 1), lengths, self.stride).sum(1)
        return group_frames(soft, lengths, self.stride).sum(1) / real


class CompactPosteriorProjector(PosteriorProjector):
    """CTC logits (Σ n, C) -> per utterance: the mean soft token of each greedy CTC
    segment (maximal run of one non-blank argmax label), in order, then blank rows.

    The segmentation (argmax) is not differentiated; the segment means are. An
    utterance never has more segments than frames, but it may have more than its
    ceil(n / stride) slots (an untrained encoder flips labels every frame): the
    surplus segments are averaged into its last slot, so the count stays the one
    the data side reserved and no frame of a neighbour is ever mixed in."""

    def forward(self, logits: torch.Tensor, lengths: Sequence[int], table: torch.Tensor,
                blank: int) -> torch.Tensor:
        lengths = [int(n) for n in lengths]
        dev = logits.device
        soft = F.softmax(logits.float(), dim=-1).to(table.dtype) @ table          # (Σ n, H)
        label = logits.argmax(-1)
        utt = torch.repeat_interleave(torch.arange(len(lengths), device=dev), torch.tensor(lengths, device=dev))
        first = torch.ones_like(label, dtype=torch.bool)
        first[1:] = (label[1:] != label[:-1]) | (utt[1:] != utt[:-1])
        keep = label != blank
        seg = torch.cumsum(first & keep, 0) - 1                                   # segment of each kept frame
        n_seg = int((first & keep).sum())
        slots = torch.tensor(self.output_lengths(lengths), device=dev)
        out = table[blank].expand(int(slots.sum()), -1).clone()
        if n_seg == 0:
            return out
        sums = soft.new_zeros(n_seg, soft.shape[1]).index_add(0, seg[keep], soft[keep])
        frames = soft.new_zeros(n_seg).index_add(0, seg[keep], soft.new_ones(int(keep.sum())))
        seg_utt = utt[first & keep]                                               # utterance of each segment
        seg_start = torch.cumsum(torch.bincount(seg_utt, minlength=len(lengths)), 0) - \
            torch.bincount(seg_utt, minlength=len(lengths))
        rank = torch.arange(n_seg, device=dev) - seg_start[seg_utt]
        slot_start = torch.cumsum(slots, 0) - slots
        dst = slot_start[seg_utt] + torch.minimum(rank, slots[seg_utt] - 1)
        acc = soft.new_zeros(out.shape).index_add(0, dst, sums / frames[:, None])
        count = soft.new_zeros(out.shape[0]).index_add(0, dst, soft.new_ones(n_seg))
        return torch.where(count[:, None] > 0, acc / count.clamp(min=1)[:, None], out)
