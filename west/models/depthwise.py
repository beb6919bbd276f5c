"""The Conformer's depthwise convolution as one opaque operator inside compiled graphs.

Traced by dynamo and AOT autograd, ``F.conv1d``'s backward specialises the time length, so compiled
blocks recompiled for every new batch length. They therefore ran the convolution as shifted
products (:func:`west.models.layout.depthwise_conv1d`). Inductor turned those into one
unfold-backward kernel of 1.7 ms per block on an H200: 20.7 of the compiled-and-replayed blocks'
41 ms, against 0.26 ms forward + backward for torch's own convolution kernels
(docs/notebook.md, run 8).

As two custom operators (forward, and the input, weight and bias gradients together), the compiled
graph calls torch's convolution kernels both ways, and the sizes stay symbolic: one compilation
for every length. Eager code keeps calling ``F.conv1d`` directly (:func:`west.models.layout.same_conv1d`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from west.models.precision import autocast_dtype


@torch.library.custom_op("west::depthwise_conv1d", mutates_args=())
def _conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pad: int) -> torch.Tensor:
    return F.conv1d(x, weight, bias, padding=pad, groups=x.shape[1])


@_conv.register_fake
def _conv_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pad: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1], x.shape[2] + 2 * pad - weight.shape[-1] + 1)


@torch.library.custom_op("west::depthwise_conv1d_backward", mutates_args=())
def _conv_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gx, gw, gb = torch.ops.aten.convolution_backward(grad, x, weight, [weight.shape[0]], [1], [pad], [1], False, [0],
                                                     x.shape[1], [True, True, True])
    return gx, gw, gb


@_conv_backward.register_fake
def _conv_backward_fake(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0])


def _setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, bias, pad = inputs
    ctx.save_for_backward(x, weight)
    ctx.pad, ctx.has_bias = pad, bias is not None


def _backward(ctx, grad: torch.Tensor):
    x, weight = ctx.saved_tensors
    gx, gw, gb = _conv_backward(grad.contiguous(), x, weight, ctx.pad)
    return gx, gw, gb if ctx.has_bias else None, None


_conv.register_autograd(_backward, setup_context=_setup)


def depthwise_conv_op(x: torch.Tensor, conv: torch.nn.Conv1d) -> torch.Tensor:
    """``conv`` (depthwise, odd kernel k) over (N, C, T) with (k-1)/2 zeros at both ends, through the
    custom operator, in the dtype autocast would give ``F.conv1d`` (the operator itself is not
    autocast)."""
    k = conv.kernel_size[0]
    if conv.groups != x.shape[1] or conv.out_channels != x.shape[1] or k % 2 == 0:
        raise ValueError(f"depthwise_conv_op needs a depthwise convolution of odd kernel, got {conv}")
    dtype = autocast_dtype(x, conv.weight) or x.dtype
    bias = None if conv.bias is None else conv.bias.to(dtype)
    return _conv(x.to(dtype), conv.weight.to(dtype), bias, (k - 1) // 2)
