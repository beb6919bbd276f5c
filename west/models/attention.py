"""Attention over packed segments: every segment attends only to itself.

Tensors use the flash-attn "varlen" layout: q (total, Hq, D), k/v (total, Hkv, D)
with int32 ``cu_seqlens`` giving segment boundaries. Backends (:data:`BACKENDS`):

* ``sdpa_segments`` (:func:`segment_sdpa`): any device, any dtype. Segments of equal (or
  bucketed) length are gathered into one (G, H, n, D) batch and run through SDPA, so the
  cost follows Σ len², never (Σ len)². Optional additive score bias (Conformer rel-pos).
* ``flash``, ``torch_varlen``, ``flex``: kernels that take ``cu_seqlens`` directly
  (west.models.varlen_kernels).
* ``auto``: :func:`west.models.varlen_kernels.choose_backend` per device and dtype.
* :func:`reference_attention`: dense float64 block-diagonal attention, for tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from west.batch import host_to_device
from west.models.buckets import bucket_length
from west.models.config import BACKENDS
from west.models.flex import DocumentMask
from west.models.shared_prefix import KeyRows, keyed_sdpa
from west.models.varlen_kernels import (
    HALF,
    choose_backend,
    flash_attn_varlen_reference,
    flash_available,
    flash_varlen,
    flex_document_attention,
    torch_varlen,
)


# --------------------------------------------------------------------------- plan
@dataclass
class SegmentGroup:
    length: int                   # padded length n of every segment in the group
    index: torch.Tensor           # (G, n) int64 rows into the flat tensor (pads repeat a real row)
    valid: Optional[torch.Tensor] # (G, n) bool, False on padding; None if no padding
    pad: Optional[torch.Tensor] = field(init=False)  # ~valid, built once with the plan, not per layer

    def __post_init__(self) -> None:
        self.pad = None if self.valid is None else ~self.valid


@dataclass
class SegmentPlan:
    """How to run per-segment attention over a flat (rows, H, D) tensor.

    Built once per batch on the host from Python lengths (no device sync), its index
    tensors moved with one non-blocking copy each, then shared by every layer."""
    lengths: list
    rows: int
    groups: list = field(default_factory=list)
    # for each flat row, its row in the concatenated (G*n)-row group outputs (padding included):
    # one gather back for all groups; None = identity (no padding, one group in order)
    inverse: Optional[torch.Tensor] = None
    gather: Optional[torch.Tensor] = None   # rows of every group, concatenated; None = every row in order
    # one group over rows already in its order (a padded batch, packed rows gathered into one
    # group): segment SDPA is traced into compiled graphs. A bool, so dynamo guards on it, not on
    # the number of groups.
    one_group: bool = field(init=False)

    def __post_init__(self) -> None:
        self.one_group = len(self.groups) == 1 and self.gather is None

    @property
    def max_len(self) -> int:
        return max(self.lengths, default=0)

    def gather_index(self) -> Optional[torch.Tensor]:
        """Rows of every group, concatenated (one gather for all groups: one backward buffer
        instead of a full-size zero-filled gradient per group); None when that is every row
        in order (a padded batch), so the groups are plain views."""
        return self.gather

    def gathered(self) -> "SegmentPlan":
        """This plan over rows already gathered by :meth:`gather_index` (groups concatenated):
        the groups become views, as in a padded batch, and the output still comes back in flat
        order. Gathering a layer's input once saves gathering q, k and v (and their backward)."""
        if self.gather is None:
            return self
        return SegmentPlan(lengths=self.lengths, rows=int(self.gather.numel()), groups=self.groups,
                           inverse=self.inverse, gather=None)

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int],
        device: torch.device | str = "cpu",
        buckets_per_octave: Optional[int] = None,
    ) -> "SegmentPlan":
        """Plan for segments laid end to end (flat rows 0..Σlen-1)."""
        lengths = [int(n) for n in lengths]
        if any(n < 0 for n in lengths):
            raise ValueError(f"segment lengths must be >= 0, got {lengths}")
        lens = np.array(lengths, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        s = int(lens.sum())
        by_len: dict[int, list[int]] = {}
        longest = max(lengths, default=0)
        for i, n in enumerate(lengths):
            if n > 0:
                by_len.setdefault(bucket_length(n, buckets_per_octave, longest), []).append(i)
        groups, rows, places, flat_index, offset = [], [], [], [], 0
        for n_pad in sorted(by_len):    # index arithmetic in numpy: host work, no tensor ops
            segs = np.array(by_len[n_pad])
            ar = np.arange(n_pad)
            valid = ar[None, :] < lens[segs][:, None]
            index = starts[segs][:, None] + np.where(valid, ar[None, :], 0)
            groups.append(SegmentGroup(length=n_pad, index=host_to_device(index, device),
                                       valid=None if valid.all() else host_to_device(valid, device)))
            rows.append(index[valid])                              # real rows, in group order
            places.append(np.flatnonzero(valid) + offset)          # their rows in the group outputs
            flat_index.append(index.reshape(-1))
            offset += index.size
        inverse_index = gather_index = None
        if groups:
            inverse = np.empty(s, dtype=np.int64)
            inverse[np.concatenate(rows)] = np.concatenate(places)
            if not (offset == s and np.array_equal(inverse, np.arange(s))):
                inverse_index = host_to_device(inverse, device)
            gather = np.concatenate(flat_index)
            if not (gather.size == s and np.array_equal(gather, np.arange(s))):
                gather_index = host_to_device(gather, device)
        return cls(lengths=lengths, rows=s, groups=groups, inverse=inverse_index, gather=gather_index)

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: torch.Tensor, device=None, buckets_per_octave: Optional[int] = None
    ) -> "SegmentPlan":
        """Plan from boundaries; pass the HOST copy of ``cu_seqlens`` (a device one costs a sync)."""
        cu = cu_seqlens.detach().to("cpu", torch.int64)
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and be non-decreasing, got {cu.tolist()}")
        device = cu_seqlens.device if device is None else device
        return cls.from_lengths(torch.diff(cu).tolist(), device, buckets_per_octave)

    @classmethod
    def padded(cls, lengths: Sequence[int], max_len: int, device="cpu") -> "SegmentPlan":
        """Plan for a right-padded (B, T) batch flattened to (B*T) rows: one group, all rows kept."""
        lengths = [int(n) for n in lengths]
        if any(n > max_len for n in lengths):
            raise ValueError(f"length > padded size {max_len}: {lengths}")
        valid = np.arange(max_len)[None, :] < np.array(lengths, dtype=np.int64)[:, None]
        index = np.arange(len(lengths) * max_len).reshape(len(lengths), max_len)
        group = SegmentGroup(max_len, host_to_device(index, device),
                             None if valid.all() else host_to_device(valid, device))
        return cls(lengths=lengths, rows=len(lengths) * max_len, groups=[group] if lengths else [])


# --------------------------------------------------------------------------- segment SDPA
BiasFn = Callable[[torch.Tensor, SegmentGroup], torch.Tensor]


def segment_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SegmentPlan,
    causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    bias_fn: Optional[BiasFn] = None,
) -> torch.Tensor:
    """Per-segment SDPA. q (rows, Hq, D), k/v (rows, Hkv, D) -> (rows, Hq, D).

    ``bias_fn(qg (G, Hq, n, D), group) -> (G, Hq, n, n)`` adds a score term (already
    scaled) per :class:`SegmentGroup` from its gathered queries, e.g. the Conformer's
    relative-position term (it reads n from ``qg``'s shape, not ``group.length``, so a compiled
    caller does not specialise on it). Padding inside a group sits at the END of each segment:
    causal masking alone hides it from real queries; without causality it is masked as keys.
    Padded query rows are dropped.

    Under ``torch.compile`` a plan of one group over rows already in group order (a padded
    batch, or packed rows gathered into one group) is traced into the caller's graph: its
    sizes come from tensor shapes, so they turn dynamic instead of recompiling. Plans of several
    groups loop in Python over host lists and run outside compiled graphs."""
    if plan.one_group:
        return _segment_sdpa(q, k, v, plan, causal, scale, dropout_p, bias_fn)
    return _segment_sdpa_eager(q, k, v, plan, causal, scale, dropout_p, bias_fn)


def _segment_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan, causal: bool,
                  scale: Optional[float], dropout_p: float, bias_fn: Optional[BiasFn]) -> torch.Tensor:
    if not torch.compiler.is_compiling() and q.shape[0] != plan.rows:   # a Python int: no guard on it
        raise ValueError(f"plan covers {plan.rows} rows, q has {q.shape[0]}")
    gqa = q.shape[1] != k.shape[1]
    index = plan.gather_index()
    sizes = [g.index.numel() for g in plan.groups]
    q_all, k_all, v_all = (t if index is None else t.index_select(0, index) for t in (q, k, v))
    parts = []
    for g, qs, ks, vs in zip(plan.groups, q_all.split(sizes), k_all.split(sizes), v_all.split(sizes)):
        G, n = g.index.shape
        qg, kg, vg = (x.view(G, n, *x.shape[1:]).transpose(1, 2) for x in (qs, ks, vs))  # (G, H, n, D)
        mask, is_causal = None, causal
        if bias_fn is not None:
            mask = bias_fn(qg, g).to(qg.dtype)
            if g.pad is not None:
                mask = mask.masked_fill(g.pad[:, None, None, :], float("-inf"))
            if causal:
                tri = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
                mask = mask.masked_fill(~tri, float("-inf"))
                is_causal = False
        elif g.valid is not None and not causal:
            mask = g.valid[:, None, None, :]
        og = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
        parts.append(og.transpose(1, 2).reshape(G * n, og.shape[1], og.shape[-1]))
    if not parts:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if plan.inverse is None else out.index_select(0, plan.inverse)


_segment_sdpa_eager = torch.compiler.disable(_segment_sdpa)   # loops over host lists: outside compiled graphs


# --------------------------------------------------------------------------- dispatch
class LazySegmentPlan:
    """A packed batch's attention plans, built from the HOST copy of ``cu_seqlens`` on first use
    and then shared by every layer: segment SDPA's :class:`SegmentPlan` and FlexAttention's
    document mask. Kernels that take ``cu_seqlens`` directly (flash, torch_varlen) build neither."""

    def __init__(self, cu_seqlens: torch.Tensor, buckets_per_octave: Optional[int] = 8) -> None:
        self.cu_seqlens, self.buckets, self._plan = cu_seqlens, buckets_per_octave, None
        self._masks: dict = {}

    def get(self, device: torch.device) -> SegmentPlan:
        if self._plan is None:
            self._plan = SegmentPlan.from_cu_seqlens(self.cu_seqlens, device=device, buckets_per_octave=self.buckets)
        return self._plan

    def doc_mask(self, device: torch.device, causal: bool):
        if causal not in self._masks:
            lengths = torch.diff(self.cu_seqlens.detach().to("cpu", torch.int64)).tolist()
            self._masks[causal] = DocumentMask(lengths, device, causal)
        return self._masks[causal]


@torch.compiler.assume_constant_result   # decided once per (device, dtype, dropout), not traced
def auto_backend(device: torch.device, dtype: torch.dtype, dropout: bool) -> str:
    return choose_backend(device, dtype, dropout=dropout)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    plan: Union[SegmentPlan, LazySegmentPlan, None] = None,
    keys: Optional[KeyRows] = None,
) -> torch.Tensor:
    """Self-attention within each segment; q (rows, Hq, D), k/v (rows, Hkv, D). With ``keys``
    (a pack row's shared prefix, west.models.shared_prefix) each segment attends to the key rows
    ``keys`` gathers for it instead, causal aligned bottom-right.

    Under ``torch.compile`` the kernels that take ``cu_seqlens`` (torch's varlen op, flash-attn)
    are traced into the caller's graph, so a decoder layer compiles whole; the paths built on
    host plans (segment SDPA, FlexAttention's document mask) run outside compiled graphs."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = auto_backend(q.device, q.dtype, dropout_p > 0)
    if backend in ("flash", "torch_varlen") and q.is_cuda and q.dtype not in HALF:
        raise ValueError(f"{backend} needs fp16/bf16 inputs, got {q.dtype} (use bf16 precision or backend 'auto')")
    cu_k, max_k = cu_seqlens, max_seqlen
    if keys is not None and backend in ("flash", "torch_varlen"):   # the kernels take the keys gathered
        k, v = k.index_select(0, keys.index), v.index_select(0, keys.index)
        cu_k, max_k = keys.cu_seqlens, keys.max_seqlen
    if backend == "flash":
        return flash_varlen(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k,
                            dropout_p=dropout_p, softmax_scale=scale, causal=causal)
    if backend in ("flex", "torch_varlen") and dropout_p:
        raise NotImplementedError(f"{backend} backend: attention dropout is not supported (use auto)")
    if backend == "torch_varlen":
        keyed = keys is not None   # self-attention: the kernel takes the query boundaries twice
        return torch_varlen(q, k, v, cu_seqlens, max_seqlen, causal=causal, scale=scale,
                            cu_seqlens_k=cu_k if keyed else None, max_seqlen_k=max_k if keyed else None)
    return _planned_attention(q, k, v, cu_seqlens, causal, scale, dropout_p, backend, plan, keys)


@torch.compiler.disable   # host plans and Python loops over them: left out of compiled graphs
def _planned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                       scale: Optional[float], dropout_p: float, backend: str,
                       plan: Union[SegmentPlan, LazySegmentPlan, None], keys: Optional[KeyRows]) -> torch.Tensor:
    if keys is not None:
        if backend == "flex":
            raise NotImplementedError("flex backend: a shared prefix (data.shared_prefix) is not supported; "
                                      "use sdpa_segments, torch_varlen or flash")
        host_cu = plan.cu_seqlens if isinstance(plan, LazySegmentPlan) else cu_seqlens
        return keyed_sdpa(q, k, v, keys.plan(host_cu, q.device, causal), scale=scale, dropout_p=dropout_p)
    if backend == "flex":
        mask = plan.doc_mask(q.device, causal) if isinstance(plan, LazySegmentPlan) else None
        return flex_document_attention(q, k, v, cu_seqlens, causal=causal, scale=scale, mask=mask)
    if isinstance(plan, LazySegmentPlan):
        plan = plan.get(q.device)
    elif plan is None:
        plan = SegmentPlan.from_cu_seqlens(cu_seqlens, device=q.device, buckets_per_octave=8)
    return segment_sdpa(q, k, v, plan, causal=causal, scale=scale, dropout_p=dropout_p)


# --------------------------------------------------------------------------- reference
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        causal: bool = False, scale: Optional[float] = None,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense float64 attention with a block-diagonal (document) mask; the ground truth.

    ``bias`` (Hq, rows, rows) is added to the scaled scores. Returns float64."""
    q, k, v = q.double(), k.double(), v.double()
    total, hq, d = q.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = cu_seqlens.to("cpu", torch.int64)
    doc = torch.searchsorted(cu[1:], torch.arange(total), right=True).to(q.device)
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= torch.ones(total, total, dtype=torch.bool, device=q.device).tril()
    s = torch.einsum("qhd,khd->hqk", q, k) * (scale if scale is not None else d ** -0.5)
    if bias is not None:
        s = s + bias.double()
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


__all__ = [
    "BACKENDS", "SegmentPlan", "SegmentGroup", "LazySegmentPlan", "bucket_length", "segment_sdpa",
    "flash_attn_varlen_reference", "flash_varlen", "flash_available", "torch_varlen", "choose_backend",
    "flex_document_attention", "varlen_attention", "reference_attention",
]
