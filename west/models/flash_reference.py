"""flash-attn's varlen attention in pure torch, for machines without it (the CPU, tests, counts).

:func:`flash_attn_varlen_reference` has ``flash_attn.flash_attn_varlen_func``'s signature and
semantics (GQA by head groups, causal mask aligned bottom-right, rows without a key give 0).
It runs as one custom operator forward and one backward (an exact, analytic backward), as
flash-attn's kernel and torch's ``varlen_attn`` dispatch on CUDA: an operator count taken on the
CPU sees what the GPU route dispatches, and ``torch.compile`` traces it as one opaque call.
It computes in float32, or float64 for float64 inputs (west.models.precision). Slow: a Python loop over segments.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from west.models.precision import accumulation_dtype


def check_cu(cu: torch.Tensor, total: int, name: str) -> None:
    """dtype always; the end only on a host tensor: reading a device one back would stall every layer
    (SpeechLLM checks the batch's host copy once per batch instead)."""
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (flash-attn convention), got {cu.dtype}")
    if cu.device.type == "cpu" and int(cu[-1]) != total:
        raise ValueError(f"{name}[-1]={int(cu[-1])} but the tensor has {total} rows")


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
    """Pure-torch stand-in with ``flash_attn.flash_attn_varlen_func``'s signature and semantics:
    q (rows_q, Hq, D), k (rows_k, Hkv, D), v (rows_k, Hkv, Dv) -> (rows_q, Hq, Dv)."""
    if dropout_p:
        raise NotImplementedError("the reference implementation has no dropout")
    if not torch.compiler.is_compiling():   # reads the boundaries: eager only (a traced call is opaque)
        check_cu(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
        check_cu(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        if (max(b - a for a, b in zip(cq, cq[1:])) > max_seqlen_q
                or max(b - a for a, b in zip(ck, ck[1:])) > max_seqlen_k):
            raise ValueError("a segment is longer than max_seqlen")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return torch.ops.west.varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, float(scale), bool(causal))


def _segments(q, k, v, cu_q, cu_k, causal: bool) -> Iterator[tuple]:
    """Per non-empty query segment: (query rows, key rows, q, k, v as (H, len, D) in the compute
    dtype with k/v heads repeated for GQA, the causal keep-mask or None)."""
    rep = q.shape[1] // k.shape[1]
    dt = accumulation_dtype(q.dtype)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for (qa, qb), (ka, kb) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        if qb == qa:
            continue
        qs = q[qa:qb].transpose(0, 1).to(dt)
        ks = k[ka:kb].repeat_interleave(rep, dim=1).transpose(0, 1).to(dt)
        vs = v[ka:kb].repeat_interleave(rep, dim=1).transpose(0, 1).to(dt)
        keep = None
        if causal:
            lq, lk = qb - qa, kb - ka
            keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        yield slice(qa, qb), slice(ka, kb), qs, ks, vs, keep


def _probs(qs, ks, keep, scale: float) -> torch.Tensor:
    s = qs @ ks.transpose(1, 2) * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)   # rows with no key -> 0, like flash


@torch.library.custom_op("west::varlen_reference", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
             scale: float, causal: bool) -> torch.Tensor:
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for rq, _, qs, ks, vs, keep in _segments(q, k, v, cu_q, cu_k, causal):
        out[rq] = (_probs(qs, ks, keep, scale) @ vs).transpose(0, 1).to(q.dtype)
    return out


@_forward.register_fake
def _(q, k, v, cu_q, cu_k, scale, causal):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


@torch.library.custom_op("west::varlen_reference_backward", mutates_args=())
def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
              cu_k: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax attention's gradients per segment: dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O)),
    dQ = dS K · scale, dK = dSᵀ Q · scale; the repeated k/v heads of GQA summed back."""
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rq, rk, qs, ks, vs, keep in _segments(q, k, v, cu_q, cu_k, causal):
        p = _probs(qs, ks, keep, scale)
        go = grad[rq].transpose(0, 1).to(qs.dtype)                   # (H, lq, Dv)
        dp = go @ vs.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[rq] = (ds @ ks * scale).transpose(0, 1).to(dq.dtype)
        h, lk = ks.shape[0], ks.shape[1]
        dks = (ds.transpose(1, 2) @ qs * scale).view(h // rep, rep, lk, -1).sum(1)
        dvs = (p.transpose(1, 2) @ go).view(h // rep, rep, lk, -1).sum(1)
        dk[rk] += dks.transpose(0, 1).to(dk.dtype)
        dv[rk] += dvs.transpose(0, 1).to(dv.dtype)
    return dq, dk, dv


@_backward.register_fake
def _(grad, q, k, v, cu_q, cu_k, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, scale, causal = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.scale, ctx.causal = scale, causal


def _autograd(ctx, grad):
    dq, dk, dv = torch.ops.west.varlen_reference_backward(grad, *ctx.saved_tensors, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None, None


_forward.register_autograd(_autograd, setup_context=_setup_context)
