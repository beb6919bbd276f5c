"""``train.bf16_weights``: a model's trainable float32 weights enter bf16 products as persistent
bf16 working copies, refreshed by one multi-tensor copy after each optimizer step.

Under bf16 autocast every trainable float32 weight and bias a product reads is cast to bf16 in
the forward, and its bf16 gradient is cast back to float32 in the backward: two operators per
tensor per step, about 600 at the seed's shapes (the Conformer's linear and convolution layers
and its positional biases, the projector). On a GPU each is a launch the host has to issue, and
the seed's step is paced by the host (docs/benchmarks.md).

Here the modules keep their float32 parameters, which stay what the optimizer updates and what
checkpoints save (the master weights). Each trainable float32 parameter gets a working copy,
made at its first use. Trainable ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` layers are routed
to multiply with the copies, so autocast has nothing to cast; other code opts in where it casts a
parameter itself (:func:`cast`) or hands one to a product (:func:`autocast_weights`).
:meth:`WorkingWeights.collect_grads` moves the copies' gradients onto the masters after each
backward, in one multi-tensor copy; :meth:`WorkingWeights.refresh` updates the copies after the
optimizer step, in another. Memory: the copies (2 bytes per parameter used) and the float32
gradients stay allocated between steps; the step's peak grows by the copies' bf16 gradients
(2 bytes per parameter: 80 MB for a 40M Conformer), as autocast's casts live through forward and
backward anyway.

Exact: autocast rounds a weight to bf16 the same way; a product's weight gradient is bf16 either
way, and widening it to float32 is exact; the gradients of several micro-batches are summed in
float32 on the masters, as autograd sums them. ``tests/test_train_bf16_weights.py`` compares
losses, gradients and updated weights with plain autocast, bit for bit.

A stale copy is never used. The training step refreshes every copy after the optimizer step
(torch's fused AdamW does not bump version counters). Any other change is caught at use, by
comparing the master's version counter (bumped by in-place changes such as ``load_state_dict``)
and storage (``.data`` replaced, a move to another device) with those seen at the copy's last
refresh; a stale copy is refreshed on the spot. Where autocast is off or not bf16, for a frozen
parameter, and inside ``torch.compile`` (which fuses the casts into its own kernels), the stock
code runs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from west.models.precision import autocast_dtype
from west.models.routing import route_forward, routed_to, tensor_state

DTYPE = torch.bfloat16
ATTR = "_west_working_copy"   # a registered parameter's _Copy
ROUTED = (nn.Linear, nn.Conv1d, nn.Conv2d)


class _Copy:
    """One master parameter's bf16 working copy and the master's state when it was last copied."""

    __slots__ = ("master", "tensor", "seen")

    def __init__(self, master: nn.Parameter):
        self.master = master
        self.tensor: Optional[torch.Tensor] = None
        self.seen: tuple = ()

    def state(self) -> tuple:
        """What changes when the master does: its version counter (in-place changes such as
        ``load_state_dict``) and its storage (``.data`` replaced, a move to another device)."""
        return tensor_state(self.master)

    def fresh(self) -> torch.Tensor:
        """The copy, brought up to date first if the master changed since its last copy."""
        state = self.state()
        if state != self.seen:
            with torch.no_grad():
                if self.tensor is None or self.tensor.device != self.master.device:
                    self.tensor = self.master.detach().to(DTYPE).requires_grad_(True)
                else:
                    self.tensor.copy_(self.master)
            self.seen = state
        return self.tensor


def _working(param: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    copy = getattr(param, ATTR, None)
    return copy.fresh() if copy is not None and param.requires_grad else param


def autocast_weights(x: torch.Tensor, *params: Optional[torch.Tensor]) -> tuple:
    """``params`` as a product with ``x`` should take them: their working copies where they have
    one and autocast runs ``x``'s products in bf16; else the parameters (autocast casts them)."""
    if torch.compiler.is_compiling() or autocast_dtype(x) != DTYPE:
        return params
    return tuple(_working(p) for p in params)


def cast(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``param.to(dtype)``, or its working copy when that is bf16 already."""
    if dtype == DTYPE and not torch.compiler.is_compiling():
        param = _working(param)
    return param.to(dtype)


def clear_working_grads(model: nn.Module) -> None:
    """Release the gradients the working copies of ``model``'s parameters hold: what
    ``model.zero_grad(set_to_none=True)`` does for the parameters themselves, for code that runs
    a backward outside the training step (whose :meth:`WorkingWeights.collect_grads` moves them)."""
    for p in model.parameters():
        copy = getattr(p, ATTR, None)
        if copy is not None and copy.tensor is not None:
            copy.tensor.grad = None


def _working_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, *autocast_weights(x, self.weight, self.bias))


def _working_conv(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self._conv_forward(x, *autocast_weights(x, self.weight, self.bias))


def uses_working_weights(module: nn.Module) -> bool:
    """Whether :class:`WorkingWeights` routed this layer."""
    return routed_to(module, _working_linear) or routed_to(module, _working_conv)


class WorkingWeights:
    """The bf16 working copies of a model's trainable float32 parameters (see the module docstring).
    Build it once, before the optimizer steps; hand it to ``west.train.step.train_step``."""

    def __init__(self, model: nn.Module):
        self.copies: list[_Copy] = []
        for p in model.parameters():
            if p.requires_grad and p.dtype == torch.float32 and not hasattr(p, ATTR):
                setattr(p, ATTR, _Copy(p))
                self.copies.append(getattr(p, ATTR))
        self.routed = 0   # layers whose forward multiplies with the copies
        for module in model.modules():
            if type(module) in ROUTED and module.weight.requires_grad and module.weight.dtype == torch.float32:
                route_forward(module, _working_linear if type(module) is nn.Linear else _working_conv)
                self.routed += 1
        self._grads: list[Optional[torch.Tensor]] = [None] * len(self.copies)   # float32, made at first need

    def __len__(self) -> int:
        return len(self.copies)

    def used(self) -> list[_Copy]:
        """The copies made so far (a parameter's copy is made at its first use)."""
        return [c for c in self.copies if c.tensor is not None]

    def describe(self) -> str:
        """One line for the run's log."""
        return (f"train.bf16_weights: {self.routed} Linear/Conv layers and the code that casts parameters itself "
                f"multiply with bf16 working copies (made at first use, of up to {len(self.copies)} float32 tensors)")

    def collect_grads(self) -> None:
        """Move the copies' gradients onto the masters (after each backward): a master without a
        gradient gets one (persistent float32 storage, one multi-tensor copy), one with a gradient
        of an earlier micro-batch adds to it; the copies' gradients are released."""
        new_dst, new_src, add_dst, add_src = [], [], [], []
        for i, c in enumerate(self.copies):
            grad = None if c.tensor is None else c.tensor.grad
            if grad is None:
                continue
            if c.master.grad is None:
                g = self._grads[i]
                if g is None or g.device != c.master.device:
                    g = self._grads[i] = torch.empty_like(c.master, memory_format=torch.contiguous_format)
                c.master.grad = g
                new_dst.append(g)
                new_src.append(grad)
            else:
                add_dst.append(c.master.grad)
                add_src.append(grad)
            c.tensor.grad = None
        with torch.no_grad():
            if new_dst:
                torch._foreach_copy_(new_dst, new_src)
            if add_dst:
                torch._foreach_add_(add_dst, add_src)

    def refresh(self) -> None:
        """Copy every master into its working copy after an optimizer step: one multi-tensor copy.
        Unconditional: torch's fused AdamW updates parameters without bumping their version counters."""
        live = [c for c in self.used() if c.tensor.device == c.master.device]
        if live:
            with torch.no_grad():
                torch._foreach_copy_([c.tensor for c in live], [c.master for c in live])
            for c in live:
                c.seen = c.state()
