"""``model.llm.checkpoint_scope: mlp``: recompute only a frozen LLM's SwiGLU MLPs in the backward.

Per-layer checkpointing (scope ``layer``) replays a whole decoder layer in the backward: about 40
operators each (norms with their casts, rotary, attention, MLP), plus the checkpoint framework's
own detaches and hooks. A GPU at the seed's shapes is paced by those host launches, not by their
arithmetic (docs/benchmarks.md, the H200 profile). But of the ~74 KiB per token a frozen Qwen2-1.5B
layer keeps for its backward, ~54 KiB are the MLP's three intermediate tensors (gate, up, silu(gate)
at 8960 wide); the attention half is small. So this keeps each MLP's input only and, in the
backward, recomputes gate and up (two matrix products) and then runs the same gradient
operators autograd would: no other replay, no checkpoint framework.

Under ``train.compile`` the layer's graph takes torch's checkpoint over the same three products
instead: traced, this Function's recomputation is merged with the forward's (the partitioner sees
the same products twice) and gate and up are kept after all. The compiler recomputes what a
checkpoint region holds, and there the host's launches are the compiled graph's anyway.

Only for frozen projections (``freeze_llm``, or LoRA outside the MLP): the input gradient is all
the backward computes. A projection that trains, or one LoRA has wrapped, runs the model's own
forward instead (the config refuses such setups up front; this check keeps a hand-built model
exact).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from west.models.precision import autocast_on
from west.models.routing import route_forward, routed_to

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
RECOMPUTED_SHARE = (2, 3)   # of the MLP's forward FLOPs: gate and up, two of its three equal products


class FrozenSwiGLU(torch.autograd.Function):
    """``down(silu(gate(x)) * up(x))`` with frozen weights, saving only ``x`` (``recompute``: gate and
    up run again in the backward) or gate and up (the stock path also keeps silu(gate))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
                recompute: bool = True) -> torch.Tensor:
        kind = x.device.type
        ctx.autocast = torch.get_autocast_dtype(kind) if autocast_on(kind) else None
        ctx.recompute, ctx.x_shape, ctx.x_dtype = recompute, x.shape, x.dtype
        g, u = F.linear(x, gate_w), F.linear(x, up_w)
        ctx.save_for_backward(*((x,) if recompute else (g, u)), gate_w, up_w, down_w)
        return F.linear(F.silu(g) * u, down_w)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.recompute:
            x, gate_w, up_w, down_w = ctx.saved_tensors
            dtype = ctx.autocast
            recast = torch.autocast(x.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with recast:                                                    # the forward's products again
                g = F.linear(x, gate_w)
                u = F.linear(x, up_w)
        else:
            g, u, gate_w, up_w, down_w = ctx.saved_tensors
        wg, wu, wd = (w.to(g.dtype) for w in (gate_w, up_w, down_w))        # as autocast cast them
        dh = _input_grad(dy, wd, g.shape)
        dg = torch.ops.aten.silu_backward(dh * u, g)                       # mul's and silu's gradients
        du = dh * F.silu(g)
        shape, dtype = ctx.x_shape, ctx.x_dtype
        dx = _input_grad(dg, wg, shape).to(dtype) + _input_grad(du, wu, shape).to(dtype)
        return dx, None, None, None, None


def _swiglu(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


def _input_grad(grad: torch.Tensor, weight: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A bias-free linear layer's input gradient, one 2-D product as autograd computes it."""
    return (grad.reshape(-1, grad.shape[-1]) @ weight).view(*shape[:-1], weight.shape[-1])


def is_swiglu(mlp: nn.Module) -> bool:
    """gate/up/down bias-free ``nn.Linear`` projections and a SiLU activation (Qwen2, Llama, ...)."""
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and all(type(getattr(mlp, n, None)) is nn.Linear and getattr(mlp, n).bias is None
                        for n in PROJECTIONS)


def _routed_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An MLP's forward through :class:`FrozenSwiGLU` while it trains (its projections frozen, its
    input requiring grad); the model's own forward otherwise (decoding, a projection that trains)."""
    weights = [getattr(self, n).weight for n in PROJECTIONS] if is_swiglu(self) else []
    if weights and x.requires_grad and torch.is_grad_enabled() and not any(w.requires_grad for w in weights):
        if torch.compiler.is_compiling():   # traced, the Function's recomputation is merged with the forward's
            # products and they are kept after all; torch's checkpoint is a region the compiler recomputes
            return checkpoint(_swiglu, x, *weights, use_reentrant=False)
        return FrozenSwiGLU.apply(x, *weights)
    return type(self).forward(self, x)   # a projection trains or was wrapped: the model's own forward


def recomputes(mlp: nn.Module) -> bool:
    """Whether :func:`checkpoint_mlps` routed this MLP (its products run again in the backward)."""
    return routed_to(mlp, _routed_forward)


def _frozen_swiglu(block: nn.Module, i: int) -> nn.Module:
    """Block ``i``'s MLP, refused (naming the config key) unless it is a frozen SwiGLU."""
    key, fallback = "model.llm.checkpoint_scope mlp", "use checkpoint_scope layer"
    mlp = getattr(block, "mlp", None)
    if mlp is not None and any(p.requires_grad for p in mlp.parameters()):
        raise ValueError(f"{key}: decoder layer {i}'s MLP trains (model.freeze_llm false, or model.lora on its "
                         f"projections); only frozen MLPs take this path: {fallback}")
    if mlp is None or not is_swiglu(mlp):
        raise ValueError(f"{key}: {type(block).__name__} has no SwiGLU mlp (gate_proj, up_proj, down_proj without "
                         f"bias, SiLU); {fallback}")
    return mlp


def checkpoint_mlps(blocks: list[nn.Module], layers: Optional[int] = None) -> int:
    """Route the MLP of the first ``layers`` decoder blocks (None: all) through :class:`FrozenSwiGLU`,
    recomputing; returns how many. A block without a SwiGLU ``mlp``, or whose MLP trains, is refused,
    naming the config key."""
    layers = len(blocks) if layers is None else layers
    if layers > len(blocks):
        raise ValueError(f"model.llm.checkpoint_layers {layers} > the LLM's {len(blocks)} decoder layers")
    for i, block in enumerate(blocks[:layers]):
        route_forward(_frozen_swiglu(block, i), _routed_forward)
    return layers
