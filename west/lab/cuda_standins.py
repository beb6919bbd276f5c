"""A step on the meta device that dispatches what the same step dispatches on CUDA.

Counting a step's bytes and FLOPs (west.lab.traffic) needs no arithmetic, so it runs on the meta
device at the seed's real widths in seconds, on any machine. But several of west's CUDA paths are
one kernel there and a chain of operators elsewhere. Inside :func:`cuda_kernels` each becomes one
operator of the same inputs and outputs as its kernel (``west_bench::*``, meta-only):

* the packed attention of the LLM and of the Conformer: the cu_seqlens kernel (flash-attn or
  torch's varlen; what ``auto`` picks on CUDA), forward (q, k, v -> out) and backward (grad, q, k,
  v, out -> dq, dk, dv); its FLOPs from the batch's host segment lengths;
* ``torch.rms_norm`` (``model.llm.fused_norm``): CUDA's fused kernel, forward (x -> y and one float32
  scale per row) and backward (grad, x, scale -> dx);
* dropout: CUDA's fused ``native_dropout`` (one kernel, a bool mask), not the CPU's chain.

Autocast does not run on the meta device: callers count the trainable modules in bfloat16 instead.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence
from unittest import mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import west.models.attention as attention
import west.models.conformer as conformer
from west.lab.traffic import varlen_attention_flops

NAMESPACE = "west_bench"


def _meta_only(*args, **kwargs):
    raise RuntimeError(f"{NAMESPACE} operators stand in for CUDA kernels on the meta device only")


@torch.library.custom_op(f"{NAMESPACE}::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return _meta_only()


@_attention.register_fake
def _(q, k, v, causal):
    return torch.empty_like(q)


@torch.library.custom_op(f"{NAMESPACE}::attention_backward", mutates_args=())
def _attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, causal: bool) -> list[torch.Tensor]:
    return _meta_only()


@_attention_backward.register_fake
def _(grad, q, k, v, out, causal):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, ctx.causal = inputs
    ctx.save_for_backward(q, k, v, output)


def _attention_grad(ctx, grad):
    q, k, v, out = ctx.saved_tensors
    return (*_attention_backward(grad, q, k, v, out, ctx.causal), None)


_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _meta_only()


@_rms_norm.register_fake
def _(x):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_backward", mutates_args=())
def _rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _meta_only()


@_rms_norm_backward.register_fake
def _(grad, x, scale):
    return torch.empty_like(x)


def _rms_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], output[1])


def _rms_grad(ctx, grad, _grad_scale):
    x, scale = ctx.saved_tensors
    return _rms_norm_backward(grad, x, scale)


_rms_norm.register_autograd(_rms_grad, setup_context=_rms_setup)


# the operators above, by the names the counters give them
STAND_INS = ("attention", "attention_backward", "rms_norm", "rms_norm_backward")


def _flash_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p: float = 0.0, softmax_scale=None,
                    causal: bool = False, **kwargs) -> torch.Tensor:
    return _attention(q, k, v, causal)


class _FusedOnCuda(TorchFunctionMode):
    """``torch.rms_norm`` without a weight and dropout in training as CUDA runs them: one kernel."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.rms_norm:
            x, shape = args[0], args[1]
            if kwargs.get("weight", args[2] if len(args) > 2 else None) is None and len(shape) == 1:
                return _rms_norm(x)[0]
        if func is F.dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and 0 < p < 1:
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


def attention_flop_formulas(segments: dict[bool, Sequence[int]]) -> dict[str, Callable]:
    """``Roofline.extra_flops`` for the attention stand-ins: ``segments[causal]`` are the lengths of
    the segments the (causal: LLM; else: encoder) attention of this step runs over."""
    def forward(args, out) -> int:
        q, causal = args[0], args[3]
        return varlen_attention_flops(segments[causal], q.shape[1], q.shape[2], causal)[0]

    def backward(args, out) -> int:
        q, causal = args[1], args[5]
        return varlen_attention_flops(segments[causal], q.shape[1], q.shape[2], causal)[1]

    return {"attention": forward, "attention_backward": backward}


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """Inside: the packed attention takes the cu_seqlens kernel route and runs the stand-in, the
    norms and dropout are one operator each (module docstring)."""
    flash = lambda device, dtype, dropout: "flash"   # noqa: E731  (auto's answer on CUDA with bf16)
    with mock.patch.object(attention, "auto_backend", flash), mock.patch.object(conformer, "auto_backend", flash), \
            mock.patch.object(attention, "flash_varlen", _flash_stand_in), _FusedOnCuda():
        yield
