"""Conv2d subsampling (WeNet style, no time padding), padded or packed.

Output frame t of an utterance reads input frames [S·t, S·t + receptive field),
all inside the utterance whenever t < ``west.shapes.subsampled_frames(T)``.
Packed mode therefore places every utterance at an offset that is a multiple of
the total stride S with zeros in between ("aligned layout"): one convolution
over the whole buffer then yields, for each utterance, exactly the frames it
would get alone, while the compute follows Σ T (plus < S frames per utterance)
instead of N · Tmax.

That buffer is one very tall image, for which CPU convolution kernels are
1.5-2x slower per output than for a batch of short images. So the buffer is
cut into overlapping chunks of ``chunk_frames`` outputs (each chunk carries the
receptive-field halo of its last output) and convolved as a batch: every
output frame still reads exactly the same input frames, only the kernel's
work is batched differently.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from west.batch import host_to_device
from west.models.layout import FrameLayout
from west.shapes import SUBSAMPLING_LAYERS, subsampled_frames


def receptive_field(rate: int) -> int:
    """Input frames one subsampled output frame reads (7 for rate 4)."""
    field, jump = 1, 1
    for kernel, stride in SUBSAMPLING_LAYERS[rate]:
        field += (kernel - 1) * jump
        jump *= stride
    return field


class Conv2dSubsampling(nn.Module):
    def __init__(self, input_dim: int, d_model: int, rate: int = 4, dropout: float = 0.0,
                 chunk_frames: int = 64):
        super().__init__()
        self.chunk_frames = chunk_frames   # outputs per convolved chunk (0 = whole images)
        if rate not in SUBSAMPLING_LAYERS:
            raise ValueError(f"subsampling rate must be one of {sorted(SUBSAMPLING_LAYERS)}, got {rate}")
        self.rate = rate
        layers, channels, freq = [], 1, input_dim
        for kernel, stride in SUBSAMPLING_LAYERS[rate]:
            layers += [nn.Conv2d(channels, d_model, kernel, stride), nn.ReLU()]
            channels, freq = d_model, (freq - kernel) // stride + 1
        if freq < 1:
            raise ValueError(f"input_dim {input_dim} too small for subsampling rate {rate}")
        self.conv = nn.Sequential(*layers)
        self.out = nn.Linear(d_model * freq, d_model)
        self.stride = math.prod(s for _, s in SUBSAMPLING_LAYERS[rate])
        self.receptive = receptive_field(rate)
        self.xscale = math.sqrt(d_model)
        self.dropout = nn.Dropout(dropout)

    def _frames(self, lengths: Sequence[int]) -> list[int]:
        out = [subsampled_frames(n, self.rate) for n in lengths]
        bad = [i for i, n in enumerate(out) if n < 1]
        if bad:
            raise ValueError(f"utterances {bad} are too short for subsampling rate {self.rate} "
                             f"(lengths {[int(lengths[i]) for i in bad]} fbank frames)")
        return out

    def _project(self, y: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.out(y) * self.xscale)

    def forward_padded(self, feats: torch.Tensor, lengths: Sequence[int]):
        """feats (N, Tmax, F), lengths -> (flat (N*T', D), FrameLayout)."""
        out_lens = self._frames(lengths)
        y = self._conv_images(feats)                             # (N, T', C * F')
        n, t, _ = y.shape
        layout = FrameLayout(out_lens, feats.device, padded_len=t)
        return self._project(y.reshape(n * t, -1)), layout

    def _conv_images(self, imgs: torch.Tensor) -> torch.Tensor:
        """conv over the (B, L, F) images ``imgs`` -> (B, L', C * F'), computed in chunks of outputs.

        Both layouts convolve through here: the packed buffer is one image, a padded batch
        N of them, and each image is cut into overlapping chunks of ``chunk_frames`` outputs."""
        s, field, h = self.stride, self.receptive, self.chunk_frames
        b, length = imgs.shape[0], imgs.shape[1]
        t = (length - field) // s + 1 if length >= field else 0
        if h <= 0 or t <= h:
            y = self.conv(imgs.unsqueeze(1))                     # (B, C, L', F')
            return y.transpose(1, 2).reshape(b, y.shape[2], -1)
        n = -(-t // h)
        h = -(-t // n)                    # n equal chunks: fewer than n padded outputs in all
        size = (h - 1) * s + field                               # input rows of h outputs
        need = (n - 1) * h * s + size
        imgs = F.pad(imgs, (0, 0, 0, need - length))
        chunks = imgs.unfold(1, size, h * s).transpose(2, 3)     # (B, n, size, F), overlapping views
        y = self.conv(chunks.reshape(b * n, 1, size, -1))        # (B*n, C, h, F')
        return y.view(b, n, y.shape[1], h, -1).permute(0, 1, 3, 2, 4).reshape(b, n * h, -1)[:, :t]

    def forward_packed(self, feats: torch.Tensor, lengths: Sequence[int], buckets_per_octave=8):
        """feats (Σ T, F), lengths -> (flat (Σ T', D), FrameLayout)."""
        lengths = [int(n) for n in lengths]
        if sum(lengths) != feats.shape[0]:
            raise ValueError(f"feat_cu_seqlens cover {sum(lengths)} frames, feats have {feats.shape[0]}")
        out_lens = self._frames(lengths)
        s = self.stride
        slots = -(-np.array(lengths) // s) * s                   # aligned room per utterance
        # host index arithmetic in numpy: each utterance's frames, then its outputs, shifted
        # from their packed start to their slot's
        shift = np.cumsum(slots) - slots - (np.cumsum(lengths) - lengths)
        dst = np.arange(feats.shape[0]) + np.repeat(shift, lengths)
        buf = feats.new_zeros(int(slots.sum()), feats.shape[1]).index_copy(0, host_to_device(dst, feats.device), feats)
        y = self._conv_images(buf[None])[0]                      # (T'buf, C * F')
        oshift = (np.cumsum(slots) - slots) // s - (np.cumsum(out_lens) - out_lens)
        keep = np.arange(sum(out_lens)) + np.repeat(oshift, out_lens)
        if keep.max() >= y.shape[0]:
            raise AssertionError("aligned subsampling layout is inconsistent with west.shapes")
        y = y.index_select(0, host_to_device(keep, feats.device))
        return self._project(y), FrameLayout(out_lens, feats.device, buckets_per_octave=buckets_per_octave)
