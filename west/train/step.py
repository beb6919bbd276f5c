"""One optimizer step over this rank's micro-batches: one per-token loss, forward,
backward, clip, update.

The objective of a step is  L = (Σ token CE over all micro-batches and ranks) / G
with G = Σ label tokens over the same. Each rank learns G with ONE small
all-reduce before any backward (``plan_step``), then back-propagates
``loss_sum * W / G`` per micro-batch: DDP/FSDP average gradients over the W
ranks, so the W cancels and the summed gradient is exactly dL. No micro-batch
or rank is weighted by its own token count, so packing, padding and
accumulation cannot change it.

Collectives per step, identical on every rank whatever happens: the token
all-reduce of ``plan_step`` (which also carries the preemption flag, west.train.preempt), DDP's gradient all-reduce on the last
micro-batch, and one stats all-reduce that also carries the "non-finite loss
here" flag, so all ranks skip a bad step together.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from west.batch import COUNTER_NAMES, IGNORE_INDEX, Batch, to_device
from west.ranks import all_reduce_sum, all_reduce_sum_device
from west.train.distributed import grad_sync


def count_label_tokens(batch: Batch) -> int:
    """Label positions (labels != IGNORE_INDEX): the loss denominator's share of this batch."""
    return int((batch.labels != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class StepPlan:
    """What every rank must agree on before the first backward of a step."""

    local_tokens: int
    global_tokens: int
    global_real_batches: int  # 0 -> every rank is out of data: the epoch is over
    stop_ranks: int = 0       # ranks asked to stop (a preemption signal): this is the last step

    @property
    def stop(self) -> bool:
        return self.stop_ranks > 0

    def loss_scale(self, world_size: int) -> float:
        """Multiplier for a micro-batch's summed CE (DDP divides gradients by world_size)."""
        return world_size / max(self.global_tokens, 1)


def plan_step(micro_batches: Sequence[Batch], n_real: int, stop: bool = False) -> StepPlan:
    """All-reduce [label tokens, real micro-batches, stop requested] of this rank's step in one
    collective: ``stop`` (this rank got a preemption signal) reaches every rank at the same step."""
    local = sum(count_label_tokens(b) for b in micro_batches)
    tokens, real, stop_ranks = all_reduce_sum([local, n_real, int(stop)])
    return StepPlan(local, int(tokens), int(real), int(stop_ranks))


class TooManyBadSteps(RuntimeError):
    """Raised (on every rank at the same step) after max_bad_steps non-finite steps in a row."""


class BadStepGuard:
    """Counts skipped non-finite steps; consistent across ranks because its input is global."""

    def __init__(self, max_in_row: int):
        self.max_in_row = max_in_row
        self.in_row = 0
        self.total = 0

    def update(self, bad: bool, step: int) -> None:
        if not bad:
            self.in_row = 0
            return
        self.in_row += 1
        self.total += 1
        if self.in_row >= self.max_in_row:
            raise TooManyBadSteps(f"{self.in_row} non-finite (NaN/inf) steps in a row up to step {step} "
                                  f"(train.max_bad_steps={self.max_in_row}); stopping")

    def state_dict(self) -> dict:
        return {"in_row": self.in_row, "total": self.total}

    def load_state_dict(self, sd: dict) -> None:
        self.in_row, self.total = int(sd["in_row"]), int(sd["total"])


@dataclass
class StepResult:
    status: str              # "ok" | "nonfinite" (skipped) | "empty" (no label token anywhere)
    loss: float              # per-token mean over the step, all ranks (nan if empty)
    loss_sum: float
    n_tokens: int
    n_correct: int
    grad_norm: float         # before clipping; nan when skipped
    lr: float                # the lr this step used
    counters: dict = field(default_factory=dict)  # COUNTER_NAMES summed over micro-batches and ranks
    aux: dict = field(default_factory=dict)       # AUX_KEYS summed over micro-batches and ranks
    # host seconds: queueing forward/backward/clip, blocked in the step's one read-back, queueing the
    # update. On CUDA a read-back wait near 0 means the GPU was done first: the host paces the step.
    launch_s: float = math.nan
    sync_wait_s: float = math.nan
    update_s: float = math.nan

    @property
    def applied(self) -> bool:
        return self.status == "ok"


# Optional extra sums a model may return next to loss_sum (SpeechLLM with a CTC head):
# the CE part of loss_sum, the CTC sum, utterances with a CTC target, unalignable ones.
AUX_KEYS = ("ce_sum", "ctc_sum", "ctc_utts", "ctc_infeasible")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for the forward (fp32 master weights and optimizer state)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _sum_counters(batches: Sequence[Batch]) -> list[float]:
    return [float(sum(int(b.counters.get(name, 0)) for b in batches)) for name in COUNTER_NAMES]


def _clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip in place and return the total norm before clipping, as a device tensor (no sync)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # FSDP2 returns a replicated DTensor
        norm = norm.full_tensor()
    return norm.detach().float()


# where each figure sits in the vector a step reads back: the model's sums, then host numbers, then the norm
_SUMS = ("loss_sum", "n_correct", *AUX_KEYS)


def queue_step(model: nn.Module, micro_batches: Sequence[Batch], plan: StepPlan, *, device: torch.device,
               world_size: int, grad_clip: float = 0.0, precision: str = "fp32",
               params: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
    """Forward and backward of every micro-batch, clipping, and the step's figures summed over ranks,
    all queued on the device without reading anything back: -> one float64 vector (``_SUMS``, the
    label-count mismatch flag, COUNTER_NAMES, then the gradient norm before clipping). ``params``:
    what is clipped (the optimizer's parameters; default the model's trainable ones)."""
    scale = plan.loss_scale(world_size)
    on_device: list[list[torch.Tensor]] = [[] for _ in _SUMS]
    on_host = [0.0] * len(_SUMS)             # plain numbers a model may return instead of tensors
    model_tokens = 0
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        with grad_sync(model, enabled=(i == last)):
            with autocast(device, precision):
                out = model(mb.to(device))
            (out["loss_sum"].float() * scale).backward()
            model_tokens += int(out["n_tokens"])   # a host int in SpeechLLM's output
            for j, name in enumerate(_SUMS):
                v = out.get(name, 0)
                if isinstance(v, torch.Tensor):
                    on_device[j].append(v.detach().double().reshape(()))
                else:
                    on_host[j] += float(v)
            del out
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    norm = _clip_grad_norm(params, grad_clip)   # same on every rank (gradients are already reduced)
    mismatch = float(model_tokens != plan.local_tokens)
    host = to_device(torch.tensor([*on_host, mismatch, *_sum_counters(micro_batches)], dtype=torch.float64), device)
    n = len(_SUMS)
    dev = torch.stack([torch.stack(v).sum() if v else host.new_zeros(()) for v in on_device])
    total = all_reduce_sum_device(torch.cat([host[:n] + dev, host[n:]]))
    return torch.cat([total, norm.double().reshape(1)])


def train_step(model: nn.Module, micro_batches: Sequence[Batch], plan: StepPlan,
               optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
               *, device: torch.device, world_size: int, grad_clip: float = 0.0,
               precision: str = "fp32") -> StepResult:
    """Accumulate per-token-scaled gradients of ``micro_batches`` and take one optimizer step.

    ``plan`` comes from ``plan_step`` on the same micro-batches (dummy batches included).
    Everything up to the figures of the step is queued by :func:`queue_step`; the host reads
    them once (the step's only sync: before it the GPU never waits for the host to look at a
    number). The optimizer step follows that read, because a non-finite loss or norm on any
    rank skips it on every rank.
    """
    lr = float(optimizer.param_groups[0]["lr"])
    if plan.global_tokens == 0:
        # No rank has a label token: nothing to learn, and stepping AdamW on zero gradients
        # would still move the weights (momentum, decay). Every rank takes this branch.
        counters = all_reduce_sum(_sum_counters(micro_batches))
        return StepResult("empty", math.nan, 0.0, 0, 0, math.nan, lr,
                          dict(zip(COUNTER_NAMES, map(int, counters))))
    # the optimizer's parameters: a list at hand, where walking the modules (the frozen LLM's too)
    # cost half of clipping's host time at the seed's depth on the CPU
    params = [p for group in optimizer.param_groups for p in group["params"]]
    t0 = time.perf_counter()
    queued = queue_step(model, micro_batches, plan, device=device, world_size=world_size,
                        grad_clip=grad_clip, precision=precision, params=params)
    t1 = time.perf_counter()
    values = queued.tolist()   # the sync
    t2 = time.perf_counter()
    result = read_result(values, plan, lr, t1 - t0, t2 - t1)   # raises before any update
    if result.status == "ok":   # else a non-finite loss or norm on any rank: every rank skips alike
        update(optimizer, scheduler)
    optimizer.zero_grad(set_to_none=True)
    result.update_s = time.perf_counter() - t2
    return result


def update(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
           found_inf: Optional[torch.Tensor] = None) -> None:
    """The optimizer step, then the schedule advanced. ``found_inf``
    (a device flag, train.late_readback): fused AdamW leaves weights and state as they are where it
    is set, as it does for a gradient scaler."""
    if found_inf is not None:
        optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        if found_inf is not None:
            del optimizer.found_inf
    scheduler.step()


def nonfinite_on_device(queued: torch.Tensor) -> torch.Tensor:
    """1.0 where :func:`queue_step`'s loss sum or gradient norm is NaN or inf, else 0.0, on the
    device: :func:`read_result`'s rule without reading anything back."""
    return (~torch.isfinite(queued[0]) | ~torch.isfinite(queued[-1])).float()


def read_result(values: Sequence[float], plan: StepPlan, lr: float, launch_s: float,
                sync_wait_s: float) -> StepResult:
    """The step's figures from :func:`queue_step`'s vector, read back; raises if the model counted
    other label tokens than the batches hold."""
    n = len(_SUMS)
    g_loss, g_correct = values[0], int(values[1])
    if values[n] > 0:
        raise RuntimeError(f"the model's label-token count differs from the {plan.local_tokens} labels != "
                           "IGNORE_INDEX its batches hold (on this or another rank): the model must use "
                           "Batch.labels as given (already shifted)")
    counters = dict(zip(COUNTER_NAMES, (int(c) for c in values[n + 1:-1])))
    status = "ok" if math.isfinite(g_loss) and math.isfinite(values[-1]) else "nonfinite"   # loss sum, norm
    norm = values[-1] if math.isfinite(g_loss) else math.nan
    return StepResult(status, g_loss / plan.global_tokens, g_loss, plan.global_tokens, g_correct, norm, lr,
                      counters, dict(zip(AUX_KEYS, values[2:n])), launch_s=launch_s, sync_wait_s=sync_wait_s)
