"""Where each utterance's frames sit in a flat (rows, C) tensor.

The Conformer keeps activations flat in both modes and asks the layout for the
three operations that could mix utterances:

* attention: a :class:`SegmentPlan` (per-segment groups, or one padded group);
* convolution over time: :meth:`conv_in` / :meth:`conv_out` build a buffer in
  which every utterance is surrounded by zeros (padded mode: pads zeroed +
  conv padding; packed mode: a zero-gap layout with ``pad`` zeros between
  utterances), so a kernel never reads a neighbour;
* output: :meth:`real_rows` picks each utterance's real frames in order.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from west.models.attention import SegmentPlan


class FrameLayout:
    """Flat layout of N utterances: ``packed`` (Σ len rows) or ``padded`` (N * T rows)."""

    def __init__(self, lengths: Sequence[int], device, padded_len: Optional[int] = None,
                 buckets_per_octave: Optional[int] = 8):
        self.lengths = [int(n) for n in lengths]
        if any(n < 1 for n in self.lengths):
            raise ValueError(f"every utterance needs >= 1 frame after subsampling, got lengths {self.lengths}")
        self.device = torch.device(device)
        self.packed = padded_len is None
        self.padded_len = padded_len
        if self.packed:
            self.rows = sum(self.lengths)
            self.plan = SegmentPlan.from_lengths(self.lengths, device, buckets_per_octave)
        else:
            self.rows = len(self.lengths) * padded_len
            self.plan = SegmentPlan.padded(self.lengths, padded_len, device)
        self._gap_cache: dict[int, torch.Tensor] = {}
        self._real: Optional[torch.Tensor] = None
        self._valid: Optional[torch.Tensor] = None

    @property
    def num(self) -> int:
        return len(self.lengths)

    def cu_seqlens(self) -> torch.Tensor:
        cu = torch.zeros(self.num + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(self.lengths, dtype=torch.int64).cumsum(0)
        return cu.to(self.device)

    def valid_rows(self) -> torch.Tensor:
        """(rows,) bool: True on real frames."""
        if self._valid is None:
            if self.packed:
                self._valid = torch.ones(self.rows, dtype=torch.bool, device=self.device)
            else:
                ar = torch.arange(self.padded_len)
                ln = torch.tensor(self.lengths)
                self._valid = (ar[None, :] < ln[:, None]).flatten().to(self.device)
        return self._valid

    def real_rows(self) -> Optional[torch.Tensor]:
        """Row indices of real frames in utterance order (None = all rows, packed)."""
        if self.packed:
            return None
        if self._real is None:
            self._real = self.valid_rows().nonzero().squeeze(1)
        return self._real

    # ---------------------------------------------------------------- convolution
    def _gap_index(self, pad: int) -> torch.Tensor:
        """Packed mode: buffer row of every frame when ``pad`` zeros lead and follow each utterance."""
        if pad not in self._gap_cache:
            seg = torch.repeat_interleave(torch.arange(self.num), torch.tensor(self.lengths))
            self._gap_cache[pad] = (torch.arange(self.rows) + pad * (seg + 1)).to(self.device)
        return self._gap_cache[pad]

    def conv_in(self, x: torch.Tensor, pad: int) -> torch.Tensor:
        """(rows, C) -> (B', C, T') with >= ``pad`` zeros on both sides of every utterance.

        A kernel of size 2*pad+1 with padding 0 over the result, then :meth:`conv_out`,
        gives each frame exactly its per-utterance, zero-padded convolution."""
        c = x.shape[-1]
        if self.packed:
            idx = self._gap_index(pad)
            buf = x.new_zeros(self.rows + pad * (self.num + 1), c).index_copy(0, idx, x)
            return buf.t().unsqueeze(0)
        y = x.masked_fill(~self.valid_rows()[:, None], 0.0).view(self.num, self.padded_len, c)
        return F.pad(y.transpose(1, 2), (pad, pad))

    def conv_out(self, y: torch.Tensor, pad: int) -> torch.Tensor:
        """Inverse of :meth:`conv_in` for a same-length convolution output (padding 0)."""
        if self.packed:
            return y[0].t().index_select(0, self._gap_index(pad) - pad)
        return y.transpose(1, 2).reshape(self.rows, y.shape[1])
