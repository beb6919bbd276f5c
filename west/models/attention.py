"""Attention over packed segments: every segment attends only to itself.

Tensors use the flash-attn "varlen" layout: q (total, Hq, D), k/v (total, Hkv, D)
with int32 ``cu_seqlens`` giving segment boundaries. Backends:

* ``segment_sdpa``: any device. Segments of equal (or bucketed) length are
  gathered into one (G, H, n, D) batch and run through SDPA, so the cost follows
  Σ len², never (Σ len)². Optional additive score bias (Conformer rel-pos).
* ``flash_varlen``: the exact ``flash_attn_varlen_func`` signature. The real
  kernel is imported lazily and used on CUDA; elsewhere a pure-torch reference
  with the same signature runs (that is how CPU tests exercise the flash path).
* ``flex_document_attention``: FlexAttention with a document mask (GPU; on CPU
  torch 2.13 runs it forward-only).
* ``reference_attention``: dense float64 block-diagonal attention, for tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache, wraps
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa_segments", "flash", "flex")


# --------------------------------------------------------------------------- plan
def bucket_length(n: int, buckets_per_octave: Optional[int]) -> int:
    """Length segment ``n`` is padded to inside its group (``n`` itself if bucketing is off).

    With ``b`` buckets per octave a segment is padded by less than 1/b of its
    length, so attention FLOPs grow by < (1+1/b)² while the number of SDPA calls
    drops from "distinct lengths" to ~b·log2(max/min)."""
    if not buckets_per_octave or n <= buckets_per_octave:
        return n
    step = max(1, (1 << (n.bit_length() - 1)) // buckets_per_octave)
    return -(-n // step) * step


@dataclass
class SegmentGroup:
    length: int                   # padded length n of every segment in the group
    index: torch.Tensor           # (G, n) int64 rows into the flat tensor (pads repeat a real row)
    valid: Optional[torch.Tensor] # (G, n) bool, False on padding; None if no padding
    select: Optional[torch.Tensor]  # (#real,) int64 rows of the (G*n) group output to keep; None = all


@dataclass
class SegmentPlan:
    """How to run per-segment attention over a flat (rows, H, D) tensor.

    Built once per batch on the host (one device sync for ``cu_seqlens``), then
    shared by every layer."""
    lengths: list
    rows: int
    groups: list = field(default_factory=list)
    inverse: Optional[torch.Tensor] = None  # rows of cat(group outputs) in flat order; None = identity

    @property
    def max_len(self) -> int:
        return max(self.lengths, default=0)

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
        starts, s = [], 0
        for n in lengths:
            starts.append(s)
            s += n
        by_len: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            if n > 0:
                by_len.setdefault(bucket_length(n, buckets_per_octave), []).append(i)
        groups, order = [], []
        for n_pad in sorted(by_len):
            segs = by_len[n_pad]
            st = torch.tensor([starts[i] for i in segs], dtype=torch.int64)
            ln = torch.tensor([lengths[i] for i in segs], dtype=torch.int64)
            ar = torch.arange(n_pad, dtype=torch.int64)
            valid = ar[None, :] < ln[:, None]
            index = st[:, None] + torch.where(valid, ar[None, :], torch.zeros_like(ar)[None, :])
            padded = not bool(valid.all())
            groups.append(SegmentGroup(
                length=n_pad,
                index=index.to(device),
                valid=valid.to(device) if padded else None,
                select=valid.flatten().nonzero().squeeze(1).to(device) if padded else None,
            ))
            order.append(index[valid])
        plan = cls(lengths=lengths, rows=s, groups=groups)
        if order:
            flat = torch.cat(order)
            inverse = torch.empty_like(flat)
            inverse[flat] = torch.arange(flat.numel())
            if not torch.equal(inverse, torch.arange(flat.numel())):
                plan.inverse = inverse.to(device)
        return plan

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: torch.Tensor, device=None, buckets_per_octave: Optional[int] = None
    ) -> "SegmentPlan":
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
        ln = torch.tensor(lengths, dtype=torch.int64)
        valid = torch.arange(max_len)[None, :] < ln[:, None]
        index = torch.arange(len(lengths) * max_len).view(len(lengths), max_len)
        group = SegmentGroup(max_len, index.to(device), None if bool(valid.all()) else valid.to(device), None)
        return cls(lengths=lengths, rows=len(lengths) * max_len, groups=[group] if lengths else [])


# --------------------------------------------------------------------------- segment SDPA
BiasFn = Callable[[torch.Tensor, int], torch.Tensor]


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

    ``bias_fn(index (G, n), n) -> (G, Hq, n, n)`` adds a score term (already scaled)
    per group, e.g. the Conformer's relative-position term. Padding inside a group
    sits at the END of each segment: causal masking alone hides it from real
    queries; without causality it is masked as keys. Padded query rows are dropped."""
    if q.shape[0] != plan.rows:
        raise ValueError(f"plan covers {plan.rows} rows, q has {q.shape[0]}")
    gqa = q.shape[1] != k.shape[1]
    parts = []
    for g in plan.groups:
        G, n = g.index.shape
        qg, kg, vg = (t[g.index].transpose(1, 2) for t in (q, k, v))  # (G, H, n, D)
        mask, is_causal = None, causal
        if bias_fn is not None:
            mask = bias_fn(g.index, n).to(qg.dtype)
            if g.valid is not None:
                mask = mask.masked_fill(~g.valid[:, None, None, :], float("-inf"))
            if causal:
                tri = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
                mask = mask.masked_fill(~tri, float("-inf"))
                is_causal = False
        elif g.valid is not None and not causal:
            mask = g.valid[:, None, None, :]
        og = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
        og = og.transpose(1, 2).reshape(G * n, og.shape[1], og.shape[-1])
        parts.append(og if g.select is None else og[g.select])
    if not parts:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if plan.inverse is None else out[plan.inverse]


# --------------------------------------------------------------------------- flash varlen
def flash_attn_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
) -> torch.Tensor:
    """Pure-torch stand-in with ``flash_attn.flash_attn_varlen_func``'s signature and
    semantics (GQA by head groups, causal mask aligned bottom-right). Slow; CPU tests."""
    if dropout_p:
        raise NotImplementedError("the reference implementation has no dropout")
    _check_cu(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    _check_cu(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    rep = q.shape[1] // k.shape[1]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if max(b - a for a, b in zip(cq, cq[1:])) > max_seqlen_q or max(b - a for a, b in zip(ck, ck[1:])) > max_seqlen_k:
        raise ValueError("a segment is longer than max_seqlen")
    for (qa, qb), (ka, kb) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        if qb == qa:
            continue
        qs = q[qa:qb].transpose(0, 1).float()
        ks = k[ka:kb].repeat_interleave(rep, dim=1).transpose(0, 1).float()
        vs = v[ka:kb].repeat_interleave(rep, dim=1).transpose(0, 1).float()
        s = qs @ ks.transpose(1, 2) * scale
        if causal:
            lq, lk = qb - qa, kb - ka
            keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
            s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no key -> 0, like flash
        out[qa:qb] = (p @ vs).transpose(0, 1).to(q.dtype)
    return out


@lru_cache(maxsize=1)
def _flash_kernel():
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore
    except Exception:  # ImportError, or a CUDA/ABI mismatch raised at import
        return None
    return flash_attn_varlen_func


def flash_available(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and _flash_kernel() is not None


@wraps(flash_attn_varlen_reference, assigned=())   # flash-attn's exact signature, stated once
def flash_varlen(*args, **kwargs) -> torch.Tensor:
    """``flash_attn_varlen_func`` on CUDA when importable, else the reference (same signature)."""
    q = args[0] if args else kwargs["q"]
    fn = (_flash_kernel() if q.is_cuda else None) or flash_attn_varlen_reference
    return fn(*args, **kwargs)


# --------------------------------------------------------------------------- flex
_compiled_flex = None
_last_block_mask: tuple = ()  # (cu_seqlens object, causal, block mask): one build per batch, not per layer


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """FlexAttention with a document mask (tokens see only their own segment).

    Compiled on CUDA. On CPU torch 2.13 has no FlexAttention backward, so it is
    refused when grad is needed; forward runs unfused (materialises scores)."""
    global _compiled_flex, _last_block_mask
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = q.shape[0]
    _check_cu(cu_seqlens, total, "cu_seqlens")
    if not q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("FlexAttention has no backward on CPU; use backend 'sdpa_segments'")
    if _last_block_mask and _last_block_mask[0] is cu_seqlens and _last_block_mask[1] == causal:
        block_mask = _last_block_mask[2]
    else:
        cu = cu_seqlens.to(q.device, torch.int64)
        doc = torch.searchsorted(cu[1:], torch.arange(total, device=q.device), right=True)

        def mask_mod(b, h, qi, ki):
            same = doc[qi] == doc[ki]
            return same & (qi >= ki) if causal else same

        block_mask = create_block_mask(mask_mod, None, None, total, total, device=q.device)
        _last_block_mask = (cu_seqlens, causal, block_mask)
    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
             block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


# --------------------------------------------------------------------------- dispatch
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
    plan: Optional[SegmentPlan] = None,
) -> torch.Tensor:
    """Self-attention within each segment; q (rows, Hq, D), k/v (rows, Hkv, D).

    ``auto``: flash-attn on CUDA with fp16/bf16 when installed, else per-segment SDPA."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        use_flash = flash_available(q.device) and q.dtype in (torch.float16, torch.bfloat16)
        backend = "flash" if use_flash else "sdpa_segments"
    if backend == "flash":
        if q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flash-attn needs fp16/bf16 inputs, got {q.dtype} (use bf16 precision or backend 'auto')")
        return flash_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                            dropout_p=dropout_p, softmax_scale=scale, causal=causal)
    if backend == "flex":
        if dropout_p:
            raise NotImplementedError("flex backend: attention dropout is not supported")
        return flex_document_attention(q, k, v, cu_seqlens, causal=causal, scale=scale)
    if plan is None:
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


def _check_cu(cu: torch.Tensor, total: int, name: str) -> None:
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (flash-attn convention), got {cu.dtype}")
    if int(cu[-1]) != total:
        raise ValueError(f"{name}[-1]={int(cu[-1])} but the tensor has {total} rows")


__all__ = [
    "BACKENDS", "SegmentPlan", "SegmentGroup", "bucket_length", "segment_sdpa",
    "flash_attn_varlen_reference", "flash_varlen", "flash_available",
    "flex_document_attention", "varlen_attention", "reference_attention",
]
