"""``model.llm.fused_qkv``: a frozen attention's query, key and value projections as one product.

The decoders west trains (Qwen2, Llama, Mistral, Qwen3) project the same hidden states three times
in a row, ``q_proj(h)``, ``k_proj(h)``, ``v_proj(h)``. With frozen weights the three products are one
product against the three weight matrices stacked: one launch instead of three in the forward, and
in the backward one product for the input's gradient (after one concatenation of the three
gradients) instead of three products and the two sums that join them. At Qwen2-1.5B's shapes that is
4-5 operators fewer per layer, 110-140 per step, where a GPU at the seed's shapes waits on the host
launching operators (docs/benchmarks.md: each one the fused norm removed saved ~50 µs of host time on
an H200). Under GQA the key's and value's products are narrow (256 columns for Qwen2-1.5B) and fill a
GPU poorly alone.

How, without forking the model's attention: ``q_proj`` computes the stacked product, returns the
query's columns and parks the key's and value's; ``k_proj`` and ``v_proj`` hand those out when called
with the very tensor ``q_proj`` saw (same object, same version), and compute their own product
otherwise. Each output column is the same dot product as before; the matrix kernel may block a wider
product differently, so results agree to the kernel's rounding, not bit for bit
(tests/test_models_fused_qkv.py). The stacked weights (176 MB for Qwen2-1.5B in bf16) are made on
first use on a device and remade when one of the six tensors changes (a load, a move). Projections
that train, code being compiled (inductor plans its own products) and any other call order take the
stock path. LoRA's wrappers call their frozen base projections with the same input, so adapted
layers keep the stacked product.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from west.models.routing import route_forward, routed_to, tensor_state

# attention classes that call q_proj, k_proj and v_proj on the same hidden states in that order
STOCK_ATTENTIONS = ("Qwen2Attention", "Qwen3Attention", "LlamaAttention", "MistralAttention")
NAMES = ("q_proj", "k_proj", "v_proj")


class StackedProjections:
    """One attention's three projections, their stacked weights, and the key and value parked by
    the last query product until their projections ask for them."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
        self.layers = (q, k, v)
        self.sizes = [m.out_features for m in self.layers]
        self._key: Optional[tuple] = None
        self._weight: Optional[torch.Tensor] = None
        self._bias: Optional[torch.Tensor] = None
        self.parked: list = [None, None, None, None]   # input, its state, key columns, value columns

    def stacked(self) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(weight, bias) of the three projections stacked, made again when any of them changed;
        None where the stock products must run (a projection trains, or code is being compiled)."""
        tensors = [m.weight for m in self.layers] + [m.bias for m in self.layers if m.bias is not None]
        if torch.compiler.is_compiling() or any(t.requires_grad for t in tensors):
            return None
        key = tuple(tensor_state(t) for t in tensors)
        if key != self._key:
            with torch.no_grad():
                self._weight = torch.cat([m.weight for m in self.layers])
                biased = self.layers[0].bias is not None
                self._bias = torch.cat([m.bias for m in self.layers]) if biased else None
            self._key = key
        return self._weight, self._bias

    def take(self, x: torch.Tensor, index: int) -> Optional[torch.Tensor]:
        """The parked key (1) or value (2) columns if ``x`` is the input they came from, once."""
        p = self.parked
        if p[0] is not x or p[1] != tensor_state(x) or p[index + 1] is None:
            return None
        out, p[index + 1] = p[index + 1], None
        if p[2] is None and p[3] is None:
            self.parked = [None, None, None, None]
        return out


def _query_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    stack: StackedProjections = self._west_stack
    stacked = stack.stacked()
    if stacked is None:
        stack.parked = [None, None, None, None]
        return F.linear(x, self.weight, self.bias)
    q, k, v = F.linear(x, *stacked).split(stack.sizes, dim=-1)
    stack.parked = [x, tensor_state(x), k, v]
    return q


def _parked_forward(index: int):
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out = self._west_stack.take(x, index)
        return out if out is not None else F.linear(x, self.weight, self.bias)
    return forward


_KEY_FORWARD, _VALUE_FORWARD = _parked_forward(1), _parked_forward(2)


def stackable(attn: nn.Module) -> bool:
    """A stock attention whose three projections are plain linear layers over the same input width,
    all with a bias or all without."""
    if type(attn).__name__ not in STOCK_ATTENTIONS:
        return False
    layers = [getattr(attn, n, None) for n in NAMES]
    return (all(type(m) is nn.Linear for m in layers) and len({m.in_features for m in layers}) == 1
            and len({m.bias is None for m in layers}) == 1)


def fuse_qkv(model: nn.Module) -> int:
    """Route every stock attention's projections of ``model`` through one stacked product (in place,
    before LoRA wraps them); returns how many attentions. Refused, naming the config key, where a
    projection trains: its weights would have to be stacked again after every update."""
    count = 0
    for name, attn in model.named_modules():
        if not stackable(attn):
            continue
        q, k, v = (getattr(attn, n) for n in NAMES)
        if any(p.requires_grad for m in (q, k, v) for p in m.parameters()):
            raise ValueError(f"model.llm.fused_qkv: {name}'s projections train (model.freeze_llm false); only "
                             "frozen ones are stacked (LoRA's base projections are): set it false")
        stack = StackedProjections(q, k, v)
        for layer, fn in zip((q, k, v), (_query_forward, _KEY_FORWARD, _VALUE_FORWARD)):
            layer._west_stack = stack
            route_forward(layer, fn)
        count += 1
    return count


def is_fused(attn: nn.Module) -> bool:
    """Whether :func:`fuse_qkv` routed this attention's projections."""
    q = getattr(attn, "q_proj", None)
    return isinstance(q, nn.Module) and routed_to(q, _query_forward)
