"""Encoder frames -> LLM embeddings: stack ``stride`` frames, then an MLP.

Each utterance's frames are stacked on their own, the last partial group is
zero-filled (never dropped, never borrowed from the next utterance), so an
utterance of n encoder frames yields ``west.shapes.projected_frames(n, stride)``
embeddings: the count the data pipeline reserved as placeholder slots.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from west.models.config import ProjectorConfig
from west.shapes import projected_frames


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
        lengths = [int(n) for n in lengths]
        if sum(lengths) != x.shape[0]:
            raise ValueError(f"lengths cover {sum(lengths)} frames, x has {x.shape[0]}")
        s = self.stride
        if s > 1:
            slots = [-(-n // s) * s for n in lengths]
            if sum(slots) != x.shape[0]:  # some utterance needs zero fill
                seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
                offsets = torch.tensor([0] + slots[:-1]).cumsum(0)
                dst = (torch.arange(x.shape[0]) - starts[seg] + offsets[seg]).to(x.device)
                x = x.new_zeros(sum(slots), x.shape[1]).index_copy(0, dst, x)
            x = x.reshape(-1, s * x.shape[1])
        return self.net(x)
