"""Where each utterance's frames sit in a flat (rows, C) tensor.

The Conformer keeps activations flat in both modes and asks the layout for the
three operations that could mix utterances:

* attention: a :class:`SegmentPlan` (per-segment groups, or one padded group);
* convolution over time: :meth:`convolve` runs it where every utterance is
  surrounded by zeros (padded mode: pads zeroed, the kernel's own edge padding;
  packed mode: a zero-gap buffer with ``pad`` zeros between utterances), so a
  kernel never reads a neighbour;
* output: :meth:`real_rows` picks each utterance's real frames in order.

:class:`FlatEncoder` is the one tensor-level ``forward`` of every encoder built on it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from west.batch import host_to_device, to_device
from west.models.attention import SegmentPlan
from west.models.depthwise import depthwise_conv_op
from west.models.flex import DocumentMask


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, place: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(place)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (place,) = ctx.saved_tensors
        return grad.index_select(0, place), None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, place: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` whose backward is one gather, ``grad.index_select(0, place)``,
    instead of a zero fill and a scatter-add. Exact when row r of ``x`` sits at ``index[place[r]]``
    and every other position of ``index`` gets a zero gradient: attention groups' padding rows,
    which are masked as keys and whose query outputs are dropped (tests/test_models_conformer.py
    checks the gradients)."""
    return _GatherRows.apply(x, index, place)


def same_conv1d(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """``conv`` (odd kernel k) over (N, C, T) with (k-1)/2 zeros at both ends, output length T:
    the convolution kernel, inside a compiled graph through an opaque operator
    (west.models.depthwise: symbolic sizes, torch's kernels both ways)."""
    if torch.compiler.is_compiling():
        return depthwise_conv_op(x, conv)
    return F.conv1d(x, conv.weight, conv.bias, padding=(conv.kernel_size[0] - 1) // 2,
                    groups=conv.groups)


def depthwise_conv1d(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """``conv`` (depthwise, odd kernel k) over (N, C, T) with (k-1)/2 zeros at both ends, as a sum
    of shifted products: what compiled blocks ran until run 8 (docs/notebook.md), where inductor made its
    backward one slow kernel (west.models.depthwise); kept as the reference form the encoder's
    timing tool sets against the kernel."""
    k = conv.kernel_size[0]
    if conv.groups != x.shape[1] or conv.out_channels != x.shape[1]:
        raise ValueError(f"depthwise_conv1d needs a depthwise convolution, got {conv}")
    windows = F.pad(x, ((k - 1) // 2, (k - 1) // 2)).unfold(2, k, 1)       # (N, C, T, k)
    y = (windows * conv.weight[:, 0, None, :].to(x.dtype)).sum(-1)
    return y if conv.bias is None else y + conv.bias[:, None].to(x.dtype)


class FrameLayout:
    """Flat layout of N utterances: ``packed`` (Σ len rows) or ``padded`` (N * T rows).

    Everything is derived from the Python lengths on the host; index tensors reach the
    device through non-blocking copies (:func:`west.batch.to_device`), so building a layout
    never waits for the GPU."""

    def __init__(self, lengths: Sequence[int], device, padded_len: Optional[int] = None,
                 buckets_per_octave: Optional[int] = 8):
        self.lengths = [int(n) for n in lengths]
        if any(n < 1 for n in self.lengths):
            raise ValueError(f"every utterance needs >= 1 frame after subsampling, got lengths {self.lengths}")
        self.device = torch.device(device)
        self.packed = padded_len is None
        self.padded_len = padded_len
        self.buckets_per_octave = buckets_per_octave
        self.rows = sum(self.lengths) if self.packed else len(self.lengths) * padded_len
        # an int attribute, not max() over the list: a compiled block then guards on no list length
        self.max_len = max(self.lengths, default=0)
        self._plan: Optional[SegmentPlan] = None
        self._grouped: Optional[tuple[torch.Tensor, SegmentPlan]] = None
        self._doc_mask = None
        self._gap_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._real: Optional[torch.Tensor] = None
        self._pad: Optional[torch.Tensor] = None
        self._cu: Optional[torch.Tensor] = None
        self.attention: Optional[str] = None   # the attention route, once prepare() has decided it
        self._positions: dict[bool, torch.Tensor] = {}

    @property
    def num(self) -> int:
        return len(self.lengths)

    @property
    def plan(self) -> SegmentPlan:
        """Segment SDPA's plan (per-length groups packed, one padded group otherwise), built on first use."""
        if self._plan is None:
            self._plan = (SegmentPlan.from_lengths(self.lengths, self.device, self.buckets_per_octave) if self.packed
                          else SegmentPlan.padded(self.lengths, self.padded_len, self.device))
        return self._plan

    def doc_mask(self):
        """FlexAttention's document mask for a packed layout (west.models.flex), built on first use."""
        if not self.packed:
            raise ValueError("a document mask describes packed rows; a padded layout uses its padded plan")
        if self._doc_mask is None:
            self._doc_mask = DocumentMask(self.lengths, self.device)
        return self._doc_mask

    def grouped(self) -> tuple[torch.Tensor, torch.Tensor, SegmentPlan]:
        """Packed mode: (the rows of every attention group, concatenated; each row's place among
        them; the plan over rows gathered that way). Attention gathers its input once with
        :func:`gather_rows` instead of gathering q, k and v. Tensors always (identities when the
        groups are the rows in order), so a compiled block never branches on the batch; two
        distinct tensors even when both are identities (dynamo does not trace an autograd
        Function given the same tensor twice). Built on first use and kept."""
        if self._grouped is None:
            plan = self.plan
            rows, place = plan.gather_index(), plan.inverse
            if rows is None:
                rows = host_to_device(np.arange(self.rows), self.device)
            if place is None:
                place = host_to_device(np.arange(self.rows), self.device)
            self._grouped = (rows, place, plan.gathered())
        return self._grouped

    def prepare(self, conv_pad: int, attention: str) -> None:
        """Build now what the blocks will ask for (the ``attention`` route's plan, document mask or
        boundaries; the convolution's indices), so it is made once per batch and never inside a
        compiled block."""
        self.attention = attention
        if attention == "flex":
            self.doc_mask().block_mask()
        elif attention != "sdpa_segments":   # a kernel that takes cu_seqlens
            self.cu_seqlens()
        elif self.packed:
            self.grouped()
        else:
            _ = self.plan
        if self.packed:
            self._gap_index(conv_pad)
        else:
            self._pad_2d()

    def cu_seqlens(self) -> torch.Tensor:
        """int32 boundaries of the utterances (packed rows), built once."""
        if self._cu is None:
            self._cu = host_to_device(np.cumsum([0, *self.lengths]).astype(np.int32), self.device)
        return self._cu

    def positions(self, grouped: bool) -> torch.Tensor:
        """Each attention row's frame index inside its utterance (int64): the packed rows as they
        are, or gathered into attention groups (``grouped``, :meth:`grouped`), or a padded layout's
        rows. A group's padding rows are numbered on past the utterance's end. Built once."""
        grouped = grouped and self.packed
        if grouped not in self._positions:
            if grouped:
                groups = self.grouped()[2].groups
                pos = np.concatenate([np.tile(np.arange(g.length), g.index.shape[0]) for g in groups])
            elif self.packed:
                pos = np.arange(self.rows) - np.repeat(np.cumsum(self.lengths) - self.lengths, self.lengths)
            else:
                pos = np.tile(np.arange(self.padded_len), self.num)
            self._positions[grouped] = host_to_device(pos, self.device)
        return self._positions[grouped]

    def _host_valid(self) -> np.ndarray:
        """(N, T) bool on the host: True on real frames of a padded layout."""
        return np.arange(self.padded_len)[None, :] < np.array(self.lengths)[:, None]

    def _pad_2d(self) -> torch.Tensor:
        """(N, T) bool, True on padding (padded layout): built once, not negated in every block; its
        shape, not Python ints, sizes the views of compiled blocks."""
        if self._pad is None:
            self._pad = host_to_device(~self._host_valid(), self.device)
        return self._pad

    def real_rows(self) -> Optional[torch.Tensor]:
        """Row indices of real frames in utterance order (None = all rows, packed)."""
        if self.packed:
            return None
        if self._real is None:
            self._real = host_to_device(np.flatnonzero(self._host_valid()), self.device)
        return self._real

    # ---------------------------------------------------------------- convolution
    def _gap_index(self, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed mode, ``pad`` zeros between consecutive utterances: (for every frame, its row in
        that buffer; an empty (buffer rows, 0) tensor). Tensors only, so a compiled block sees the
        buffer's size as a shape (dynamic after the first new size), never as a Python count of
        utterances it would recompile for."""
        if pad not in self._gap_cache:
            dst = np.arange(self.rows) + pad * np.repeat(np.arange(self.num), self.lengths)
            size = torch.empty(self.rows + pad * (self.num - 1), 0, device=self.device)
            self._gap_cache[pad] = (host_to_device(dst, self.device), size)
        return self._gap_cache[pad]

    def convolve(self, x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
        """(rows, C) -> (rows, C): ``conv`` (odd kernel; its own padding is ignored) over each
        utterance's frames alone, reading zeros beyond its edges. Both layouts run one "same"
        convolution (padding (k-1)/2 at the ends) over (N, C, T) frames with zeros between
        utterances: packed, the zero-gap buffer of :meth:`conv_in`; padded, the batch with its
        padding frames zeroed. The same length in and out keeps a compiled graph's sizes symbolic."""
        pad = (conv.kernel_size[0] - 1) // 2
        if self.packed:
            return self.conv_out(same_conv1d(self.conv_in(x, pad), conv), pad)
        pads = self._pad_2d()
        y = x.masked_fill(pads.reshape(-1, 1), 0.0).view(*pads.shape, x.shape[-1]).transpose(1, 2)
        y = same_conv1d(y, conv)
        return y.transpose(1, 2).reshape(-1, y.shape[1])

    def conv_in(self, x: torch.Tensor, pad: int) -> torch.Tensor:
        """Packed (rows, C) -> (1, C, T') with ``pad`` zeros between consecutive utterances.

        A kernel of size 2*pad+1 with padding ``pad`` over the result, then :meth:`conv_out`,
        gives each frame exactly its per-utterance, zero-padded convolution. The frames are
        copied into a zeroed buffer (its backward is one gather of the frames' rows)."""
        dst, size = self._gap_index(pad)
        # (C, T') contiguous, as the convolution wants it (no copy inside it, and under compile
        # the strides it saves for its backward stay symbolic instead of specialising T')
        return x.new_zeros(x.shape[-1], size.shape[0]).index_copy_(1, dst, x.t()).unsqueeze(0)

    def conv_out(self, y: torch.Tensor, pad: int) -> torch.Tensor:
        """Inverse of :meth:`conv_in` for a same-length convolution output (padding ``pad``)."""
        return y.squeeze(0).t().index_select(0, self._gap_index(pad)[0])


class FlatEncoder(nn.Module):
    """An encoder that computes on flat rows. Subclasses define ``encode(feats, lens, packed) -> (rows,
    FrameLayout)``; ``forward_flat`` (what SpeechLLM calls) checks the input first, and ``forward`` gives
    the same result as tensors. The class methods and hooks below are what an entry of
    ``west.models.encoders`` stands for (docs/models.md, "Adding an encoder")."""

    attention_buckets: Optional[int] = 8   # how its packed attention groups segments (benchmark counts)
    packs_padded_input: bool = False       # padded feats are packed inside (benchmark counts Σ T', not N·T')
    window_mode: bool = False              # has a stock mode padded to a fixed window (model.encoder.pad_to_30s)

    @classmethod
    def from_config(cls, cfg, attn_backend: str = "auto") -> "FlatEncoder":
        """Build from the ``model.encoder`` section (loading a pretrained dir's weights);
        ``attn_backend`` is model.llm.attn_backend, for encoders run through west_varlen."""
        raise NotImplementedError

    @classmethod
    def speech_shape(cls, cfg, projector_stride: int):
        """The SpeechShape the data side needs (frame formula, longest input, mel bins, feature kind)."""
        raise NotImplementedError

    @classmethod
    def num_layers(cls, cfg) -> int:
        """Blocks ``model.freeze_encoder_blocks`` may freeze, known before building."""
        raise NotImplementedError

    def freeze_blocks(self, n: int) -> None:
        """Freeze the front end and the first ``n`` blocks (n = 0: nothing)."""
        raise NotImplementedError

    def fsdp_units(self) -> list[nn.Module]:
        """The repeated blocks FSDP2 shards (and train.compile compiles) one by one."""
        raise NotImplementedError

    @classmethod
    def release_projector(cls, path: str) -> dict:
        """The model.projector keys a released model's directory ``path`` fixes beyond its registry
        entry's ``release_projector`` (read from the directory, e.g. a hidden width); {}: none."""
        return {}

    def pretrained_projector(self) -> Optional[dict[str, torch.Tensor]]:
        """A released model's projector weights, named as west's projector names them (None: none)."""
        return None

    def encode(self, feats: torch.Tensor, lens: list[int], packed: bool) -> tuple[torch.Tensor, FrameLayout]:
        raise NotImplementedError

    def forward_flat(self, feats: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                     cu_seqlens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, FrameLayout]:
        """Encoder output as flat rows plus the layout describing them; packed feats ``(ΣT, F)`` with
        ``cu_seqlens``, or padded ``(N, T, F)`` with ``lengths``. Give the host (CPU) copies of
        ``lengths`` / ``cu_seqlens`` (``Batch.host``): read from a GPU they cost a sync."""
        if (lengths is None) == (cu_seqlens is None):
            raise ValueError("pass exactly one of lengths (padded feats) or cu_seqlens (packed feats)")
        packed = cu_seqlens is not None
        lens = (torch.diff(cu_seqlens.detach().to("cpu", torch.int64)) if packed else lengths.detach().cpu()).tolist()
        if feats.dim() != (2 if packed else 3):
            raise ValueError(f"{'packed' if packed else 'padded'} feats must be "
                             f"{'(ΣT, F)' if packed else '(N, T, F)'}, got {tuple(feats.shape)}")
        if packed and sum(lens) != feats.shape[0]:
            raise ValueError(f"cu_seqlens cover {sum(lens)} frames, feats have {feats.shape[0]}")
        if not packed and (len(lens) != feats.shape[0] or max(lens, default=0) > feats.shape[1]):
            raise ValueError(f"lengths {lens} do not fit padded feats {tuple(feats.shape)}")
        return self.encode(feats, lens, packed)

    def forward(self, feats: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed feats -> (``(ΣT', D)``, output cu_seqlens int32); padded feats -> (``(N, T', D)`` when the
        encoder keeps the padding, else ``(ΣT', D)``, output lengths int64)."""
        x, layout = self.forward_flat(feats, lengths, cu_seqlens)
        if cu_seqlens is not None:
            return x, layout.cu_seqlens()
        rows = x if layout.packed else x.view(layout.num, layout.padded_len, -1)
        return rows, to_device(torch.tensor(layout.lengths, dtype=torch.int64), x.device)
