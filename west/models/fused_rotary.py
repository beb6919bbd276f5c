"""``model.llm.fused_rotary``: the LLM's rotary position embedding as one autograd node, with
8 operators in the forward and 8 in the backward where the stock code runs 10 and about 18,
and the same values bit for bit.

Qwen2 (and Llama, Mistral, Qwen3: the same lines) rotates q and k as ``t·cos + rotate_half(t)·sin``
with ``rotate_half(x) = cat(-x₂, x₁)``. Per tensor that is two products, a negation, a
concatenation and a sum in the forward; in the backward two products, a negation, two
zero-filled slice gradients and the sums that join the three paths back into ``t``'s
gradient. At the seed's 28 layers that is about 780 kernel launches per step, and a GPU at the
seed's shapes is paced by the host launching them (docs/benchmarks.md).

``rotate_half(x)`` equals ``swap(x) = cat(x₂, x₁)`` times a sign pattern (-1 on the first half,
+1 on the second). Multiplying by ±1 is exact, so ``rotate_half(t)·sin = swap(t)·sin_s`` with
``sin_s = sin·sign``, made once per forward and shared by every layer (they all get the same
``sin`` tensor). Swapping the halves is its own inverse, so the input gradient is
``g·cos + swap(g·sin_s)``: each element is one product, one product and one sum, as in the
stock gradient, whose other terms are exact zeros.

The modeling module's ``apply_rotary_pos_emb`` is replaced for the process (what the attention
layers call; there is no per-instance hook). Only a module whose function passes a check
against the stock formula is patched, and the replacement calls the stock function for
anything else: inputs that need a gradient through ``cos``/``sin``, a rotary part narrower than
the head, and code being compiled (inductor fuses the stock operators itself).
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
from torch import nn

from west.models.routing import tensor_state

PATCHED = "_west_stock_rotary"   # the replacement function keeps the stock one under this name


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """``(x₁, x₂) -> (x₂, x₁)`` along the last dimension: one concatenation, strided input allowed."""
    half = t.shape[-1] // 2
    return torch.cat([t[..., half:], t[..., :half]], -1)


class _Rotary(torch.autograd.Function):
    """``t·cos + swap(t)·sin_s`` for q and k; gradient ``g·cos + swap(g·sin_s)``."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_s: torch.Tensor):
        ctx.save_for_backward(cos, sin_s)
        return tuple(t * cos + _swap_halves(t) * sin_s for t in (q, k))

    @staticmethod
    def backward(ctx, gq: Optional[torch.Tensor], gk: Optional[torch.Tensor]):
        cos, sin_s = ctx.saved_tensors
        grads = [None if g is None else g * cos + _swap_halves(g * sin_s) for g in (gq, gk)]
        return grads[0], grads[1], None, None


class _SignedSin:
    """``sin·sign`` (the first half negated, exact) for the last ``sin`` seen: every layer of one
    forward passes the same tensor, so it is made once per forward."""

    def __init__(self):
        self.source: Optional[torch.Tensor] = None
        self.state: tuple = ()
        self.value: Optional[torch.Tensor] = None

    def __call__(self, sin: torch.Tensor) -> torch.Tensor:
        if sin is not self.source or tensor_state(sin) != self.state:
            half = sin.shape[-1] // 2
            self.value = torch.cat([-sin[..., :half], sin[..., half:]], -1)
            self.source, self.state = sin, tensor_state(sin)
        return self.value


def make_fused(stock: Callable) -> Callable:
    """The replacement for one modeling module's ``apply_rotary_pos_emb`` (``stock``): the call
    ``(q, k, cos, sin[, unsqueeze_dim=])`` on tensors of one dtype; anything else goes to ``stock``."""
    signed = _SignedSin()

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        d = q.shape[-1]
        if (args or set(kwargs) - {"unsqueeze_dim"} or torch.compiler.is_compiling() or cos.requires_grad
                or sin.requires_grad or d % 2 or cos.shape[-1] != d or k.shape[-1] != d
                or len({q.dtype, k.dtype, cos.dtype, sin.dtype}) > 1):
            return stock(q, k, cos, sin, *args, **kwargs)
        dim = kwargs.get("unsqueeze_dim", 1)
        return _Rotary.apply(q, k, cos.unsqueeze(dim), signed(sin).unsqueeze(dim))

    setattr(apply_rotary_pos_emb, PATCHED, stock)
    return apply_rotary_pos_emb


def matches_stock(fn: Callable) -> bool:
    """Whether ``fn(q, k, cos, sin)`` computes ``t·cos + rotate_half(t)·sin``, bit for bit, in float32
    and bfloat16 (output and input gradients)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q, k = (torch.randn(1, h, 5, 8, generator=g).to(dtype).requires_grad_(True) for h in (4, 2))
        ang = torch.randn(1, 5, 4, generator=g)
        cos, sin = (f(torch.cat([ang, ang], -1)).to(dtype) for f in (torch.cos, torch.sin))
        try:
            out = fn(q, k, cos, sin)
        except Exception:
            return False
        ref = [t * cos[:, None] + torch.cat([-t[..., 4:], t[..., :4]], -1) * sin[:, None] for t in (q, k)]
        if not all(torch.equal(o, r) for o, r in zip(out, ref)):
            return False
        w = [torch.randn(r.shape, generator=g).to(dtype) for r in ref]
        got = torch.autograd.grad(out, (q, k), w)
        want = torch.autograd.grad(ref, (q, k), w)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            return False
    return True


def fuse_rotary(model: nn.Module) -> list[str]:
    """Patch ``apply_rotary_pos_emb`` of the modeling modules ``model``'s attention layers come from,
    where it is the stock formula; returns the modules patched (or already patched)."""
    done = []
    for name in sorted({type(m).__module__ for m in model.modules() if type(m).__name__.endswith("Attention")}):
        module = sys.modules.get(name)
        stock = getattr(module, "apply_rotary_pos_emb", None)
        if stock is None:
            continue
        if hasattr(stock, PATCHED) or matches_stock(stock):
            if not hasattr(stock, PATCHED):
                module.apply_rotary_pos_emb = make_fused(stock)
            done.append(name)
    return done
