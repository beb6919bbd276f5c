"""``model.llm.fused_norm``: each of the LLM's RMSNorms as one ``torch.rms_norm`` call.

Qwen2's RMSNorm (and Llama's, Mistral's, Qwen3's: the same lines) is written as eight tensor
operations: a cast to float32, square, mean, add, rsqrt, product, a cast back, and the weight's
product. On a GPU each is a kernel launch in the forward and about as many again in the backward,
57 norms per Qwen2-1.5B forward; the float32 copy it keeps for the backward is 4 bytes per
hidden value per norm. ``torch.rms_norm`` (no weight) computes the same ``x * rsqrt(mean(x²) + eps)``
in float32 and rounds once to the input's dtype, which is exactly what the stock module returns
before its weight product. On CUDA it is one fused kernel forward and one backward
(``aten::_fused_rms_norm``) that keeps the input and one float32 scale per row; elsewhere torch
runs it as those same eight operations, so CPU results are the stock module's bit for bit.

The call runs with autocast off: CUDA's autocast lists ``rms_norm`` among the float32 operators,
which would return float32 where the stock module returns the input's dtype.

Only classes whose forward is that formula are rerouted (:data:`STOCK_RMS_NORMS`; a test compares
each against its own forward); the weight's product stays a separate operation, as in the stock
module, so the output dtype and rounding are unchanged. Gemma's ``1 + weight`` norm and other
variants keep their own forward. Parameter names are unchanged: checkpoints load either way.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from west.models.precision import autocast_on
from west.models.routing import route_forward, routed_to

# transformers' RMSNorm classes written as Qwen2's (tests/test_models_fused_norm.py checks each)
STOCK_RMS_NORMS = ("Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2MoeRMSNorm", "LlamaRMSNorm", "MistralRMSNorm",
                   "Qwen2_5OmniRMSNorm")


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    # CUDA's autocast runs rms_norm in float32 (its fp32 list): a float32 output would reach the
    # projections (a cast per consumer, a float32 MLP input kept) and skip the stock rounding to
    # the input's dtype. The kernel computes in float32 anyway; without autocast it returns that dtype.
    kind = hidden_states.device.type
    with torch.autocast(kind, enabled=False) if autocast_on(kind) else contextlib.nullcontext():
        normed = torch.rms_norm(hidden_states, (hidden_states.shape[-1],), None, self.variance_epsilon)
    return self.weight * normed


def is_stock_rms_norm(module: nn.Module) -> bool:
    return (type(module).__name__ in STOCK_RMS_NORMS and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.dim() == 1 and isinstance(getattr(module, "variance_epsilon", None), (int, float)))


def fuse_rms_norms(model: nn.Module) -> int:
    """Route every stock RMSNorm of ``model`` through ``torch.rms_norm`` (in place); returns how many."""
    count = 0
    for module in model.modules():
        if is_stock_rms_norm(module):
            route_forward(module, _fused_forward)
            count += 1
    return count


def is_fused(module: nn.Module) -> bool:
    """Whether :func:`fuse_rms_norms` rerouted this module."""
    return routed_to(module, _fused_forward)
