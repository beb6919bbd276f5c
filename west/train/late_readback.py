"""``train.late_readback``: the step's figures read back one step late, so the host never waits
for the GPU between steps.

:func:`west.train.step.train_step` reads the step's figures (loss, gradient norm, counters) back
before the optimizer step, because a non-finite loss or norm skips the update on every rank. That
read waits for the GPU to finish the step's backward: on one H200 at the seed's shapes the host sat
there 35 ms per step, after which the GPU idled while the host launched the next step's first
phases (docs/notebook.md, run 6). Here the skip is decided on the device instead: fused
AdamW takes a ``found_inf`` flag and leaves the weights and its state untouched where it is set,
as it does for a gradient scaler. The figures travel to pinned host memory behind the step and are
read when the next step is queued, by which time they have arrived.

The same run trains to the same weights, step for step, with one exception: a skipped step still
advances the learning-rate schedule by one (the host learns of the skip a step later). The loop
logs each step once its figures are read: one step late, and at once before anything that reads
the weights (evaluation, a checkpoint, the end).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
from torch import nn

from west.batch import Batch
from west.schema import ConfigError
from west.train.step import StepPlan, StepResult, nonfinite_on_device, queue_step, read_result, train_step, update


class PendingStep:
    """A queued step whose figures are on their way to the host; :meth:`result` reads them."""

    def __init__(self, figures: Optional[torch.Tensor], plan: StepPlan, lr: float, launch_s: float,
                 update_s: float, ready: Optional[StepResult] = None):
        self.figures, self.plan, self.lr = figures, plan, lr
        self.launch_s, self.update_s, self.ready = launch_s, update_s, ready
        self.event = None
        if figures is not None and figures.device.type == "cpu" and figures.is_pinned():
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> StepResult:
        """The step's :class:`StepResult` (waits for its figures if they have not arrived)."""
        if self.ready is None:
            t0 = time.perf_counter()
            if self.event is not None:
                self.event.synchronize()
            values = self.figures.tolist()
            self.ready = read_result(values, self.plan, self.lr, self.launch_s, time.perf_counter() - t0)
            self.ready.update_s = self.update_s
        return self.ready


def check_fused(optimizer: torch.optim.Optimizer) -> None:
    """Late read-back needs an optimizer that can skip an update on the device (fused AdamW)."""
    if not optimizer.defaults.get("fused"):
        raise ConfigError("train.late_readback: needs fused AdamW, which skips a non-finite step on the device "
                          "(float32 parameters on one device each; not with train.fsdp's sharded ones)")


def queue_train_step(model: nn.Module, micro_batches: Sequence[Batch], plan: StepPlan,
                     optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                     *, device: torch.device, world_size: int, grad_clip: float = 0.0,
                     precision: str = "fp32") -> PendingStep:
    """:func:`west.train.step.train_step` without its read-back: forward, backward, clipping and the
    optimizer step all queued, the update skipped on the device where the loss or the gradient norm
    is not finite; the figures copied to the host behind them."""
    lr = float(optimizer.param_groups[0]["lr"])
    if plan.global_tokens == 0:   # decided on the host: no update either way
        return PendingStep(None, plan, lr, 0.0, 0.0, ready=train_step(
            model, micro_batches, plan, optimizer, scheduler, device=device, world_size=world_size))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    t0 = time.perf_counter()
    queued = queue_step(model, micro_batches, plan, device=device, world_size=world_size, grad_clip=grad_clip,
                        precision=precision, params=params)
    t1 = time.perf_counter()
    update(optimizer, scheduler, found_inf=nonfinite_on_device(queued))
    optimizer.zero_grad(set_to_none=True)
    figures = queued.to("cpu", non_blocking=True) if queued.device.type == "cuda" else queued
    return PendingStep(figures, plan, lr, t1 - t0, time.perf_counter() - t1)
