"""``train.bf16_weights``: trainable Linear layers compute with bf16 working copies of their
float32 weights, refreshed by one multi-tensor copy after each optimizer step.

Under bf16 autocast every trainable float32 Linear weight and bias is cast to bf16 in the
forward, and its bf16 gradient is cast back to float32 in the backward: two operators per
tensor per step, about 500 at the seed's shapes (12 Conformer blocks of 21 such tensors, the
subsampling's output layer, the projector). On a GPU each is a launch the host has to issue,
and the seed's step is paced by the host (docs/benchmarks.md).

Here the modules keep their float32 parameters, which stay what the optimizer updates and
what checkpoints save (the master weights). A trainable ``nn.Linear`` routed by
:class:`WorkingWeights` multiplies with persistent bf16 copies instead, so autocast has
nothing to cast. Memory: the copies (2 bytes per routed parameter) and the float32
gradients stay allocated between steps; the step's peak grows by the copies' bf16 gradients
(2 bytes per routed parameter: 80 MB for a 40M Conformer), as autocast's casts of the
weights live through forward and backward anyway. :meth:`WorkingWeights.collect_grads` moves the copies' gradients onto the
masters after each backward, in one multi-tensor copy. :meth:`WorkingWeights.refresh` updates
the copies after the optimizer step, in another.

Exact: autocast rounds a weight to bf16 the same way; a matrix product's weight gradient is
bf16 either way, and widening it to float32 is exact; the gradients of several micro-batches
are summed in float32 on the masters, as autograd sums them. ``tests/test_models_working_weights.py``
compares losses, gradients and updated weights with plain autocast, bit for bit.

A stale copy is never used. The training step refreshes every copy after the optimizer step
(torch's fused AdamW does not bump version counters). Any other change is caught by the routed
forward, which compares each master's version counter (bumped by in-place changes such as
``load_state_dict``) and storage (``.data`` replaced, a move to another device) with those seen
at the copy's last refresh, and refreshes a stale copy on the spot. Where autocast is off or
not bf16, for a frozen layer, and inside ``torch.compile`` (which fuses the casts into its own
kernels), the layer runs its stock forward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from west.models.precision import autocast_dtype
from west.models.routing import route_forward, routed_to

DTYPE = torch.bfloat16


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
        return self.master._version, self.master.data_ptr()

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


def _working_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling() or not self.weight.requires_grad or autocast_dtype(x) != DTYPE:
        return F.linear(x, self.weight, self.bias)
    weight, bias = self._west_working_copies
    return F.linear(x, weight.fresh(), None if bias is None else bias.fresh())


def uses_working_weights(module: nn.Module) -> bool:
    """Whether :class:`WorkingWeights` routed this layer."""
    return routed_to(module, _working_forward)


class WorkingWeights:
    """The bf16 working copies of a model's trainable float32 ``nn.Linear`` layers (see the module
    docstring). Build it once, before the optimizer steps; hand it to ``west.train.step.train_step``."""

    def __init__(self, model: nn.Module):
        self.copies: list[_Copy] = []
        for module in model.modules():
            if type(module) is nn.Linear and module.weight.requires_grad and module.weight.dtype == torch.float32:
                pair = [_Copy(p) if p is not None else None for p in (module.weight, module.bias)]
                module._west_working_copies = pair
                route_forward(module, _working_forward)
                self.copies += [c for c in pair if c is not None]
        self._grads: list[torch.Tensor] = []   # persistent float32 gradient tensors, one per master

    def __len__(self) -> int:
        return len(self.copies)

    def describe(self) -> str:
        """One line for the run's log."""
        n = sum(c.master.numel() for c in self.copies)
        return (f"train.bf16_weights: {len(self.copies)} float32 tensors of trainable Linear layers "
                f"({n / 1e6:.2f} M parameters) multiply with bf16 working copies")

    def collect_grads(self) -> None:
        """Move the copies' gradients onto the masters (after each backward): a master without a
        gradient gets one (persistent float32 storage, one multi-tensor copy), one with a gradient
        of an earlier micro-batch adds to it; the copies' gradients are released."""
        if len(self._grads) != len(self.copies) or any(
                g.device != c.master.device for g, c in zip(self._grads[:1], self.copies)):
            self._grads = [torch.empty_like(c.master, memory_format=torch.contiguous_format) for c in self.copies]
        new_dst, new_src, add_dst, add_src = [], [], [], []
        for c, g in zip(self.copies, self._grads):
            grad = None if c.tensor is None else c.tensor.grad
            if grad is None:
                continue
            if c.master.grad is None:
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
        live = [c for c in self.copies if c.tensor is not None and c.tensor.device == c.master.device]
        if live:
            with torch.no_grad():
                torch._foreach_copy_([c.tensor for c in live], [c.master for c in live])
            for c in live:
                c.seen = c.state()

