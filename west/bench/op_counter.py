"""Dispatched operator calls per training step: a launch count anyone can measure, on any device.

A ``TorchDispatchMode`` sees every aten operator that reaches a backend kernel (after
autograd, autocast and the decomposition of composite ops), forward and backward alike.
On a GPU each non-view call is (at least) one kernel launch, so the count says how much
host work a step costs, independently of the machine's speed. Views (``t``, ``view``,
``detach``, ...) are dispatched but launch nothing; they are counted and also reported
on their own. Ops of other namespaces (custom kernels such as flash-attn's) are counted too,
the profiler's ``record_function`` markers are not.

Attribution of one production step (``west.train.step.train_step``, unchanged):

* ``backward``: every op run while the autograd engine executes a node
  (``torch._C._current_autograd_node()`` is set), gradient accumulation included;
* ``forward``: ops inside ``model(...)`` (the model's forward pre-hook to its forward hook);
* ``optimizer``: ops inside ``optimizer.step()`` (the optimizer's step hooks);
* ``other``: the rest of the step: the loss scaling and the backward's seed gradient,
  gradient clipping, the LR scheduler, ``zero_grad`` and the step's statistics.

The speech encoder's share is counted by running the encoder alone on the same batch, as
SpeechLLM runs it (``encoder.forward_flat`` on the packed or padded feats, under the same
autocast), then its backward from a gradient of ones: exactly the ops of the encoder's own
forward and of its autograd nodes. (A method call such as ``forward_flat`` fires no module
hooks, so the encoder cannot be bracketed inside the full step.)
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from west.train.phases import phase_hooks
from west.train.step import autocast

PHASES = ("forward", "backward", "optimizer", "other")
# record_function markers (the optimizer's step and zero_grad open one): bookkeeping, no kernel
IGNORED_NAMESPACES = ("profiler",)


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops by phase: ``counts[phase][op]`` with ``op`` like ``aten.mm``
    (overloads merged). Use as a context manager; ``phase(name)`` labels a block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, Counter] = {p: Counter() for p in PHASES}
        self.views: Counter = Counter()
        self._stack: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def current_phase(self) -> str:
        if torch._C._current_autograd_node() is not None:
            return "backward"
        return self._stack[-1] if self._stack else "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace not in IGNORED_NAMESPACES:
            phase = self.current_phase()
            self.counts[phase][str(func.overloadpacket)] += 1
            if func.is_view:
                self.views[phase] += 1
        return func(*args, **(kwargs or {}))

    def totals(self) -> dict:
        """{phase: calls, "total": calls, "views": view calls of all phases}."""
        out = {p: sum(self.counts[p].values()) for p in PHASES}
        out["total"] = sum(out.values())
        out["views"] = sum(self.views.values())
        return out

    def merged(self) -> Counter:
        """Calls per op over all phases."""
        out: Counter = Counter()
        for c in self.counts.values():
            out.update(c)
        return out


def step_phases(counter: OpCounter, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    """Label ``model(...)`` as forward and ``optimizer.step()`` as optimizer while the block runs
    (the forward's parts count as forward)."""
    top = ("forward", "optimizer")

    def enter(name: str) -> None:
        if name in top:
            counter._stack.append(name)

    def leave(name: str) -> None:
        if name in top:
            counter._stack.pop()
    return phase_hooks(model, optimizer, enter, leave)


def count_step_ops(runner, batches: Sequence, warmup_steps: int = 1) -> dict:
    """One training pass over ``batches`` through ``runner`` (a west.bench.runner.PassRunner:
    fresh optimizer from the initial weights, the production step) with every dispatched op
    counted, after ``warmup_steps`` uncounted steps (as before a timed pass: one-time work such
    as lazily built caches is not a per-step cost). Returns per-step means by phase, the pass's
    totals and the top ops."""
    opt, sched = runner.fresh(len(batches))
    for b in batches[:warmup_steps]:
        runner.step(b, opt, sched)
    opt, sched = runner.fresh(len(batches))
    counter = OpCounter()
    with step_phases(counter, runner.model, opt), counter:
        for b in batches:
            runner.step(b, opt, sched)
    runner.model.load_state_dict(runner.init)
    return summary(counter, len(batches))


def count_encoder_ops(model: torch.nn.Module, batches: Sequence, device: torch.device,
                      precision: str = "fp32") -> dict:
    """The speech encoder alone on each batch's feats, forward then backward (module docstring),
    after one uncounted warm-up on the first. Leaves the model's weights untouched and its
    gradients cleared."""
    model.train()
    counter = OpCounter()
    with_feats = [b for b in batches if b.feats is not None]
    for i, b in enumerate(with_feats[:1] + with_feats):    # the first batch once more, uncounted: a warm-up
        b = b.to(device)
        mode = counter if i > 0 else contextlib.nullcontext()
        with mode, counter.phase("forward"), autocast(device, precision):
            x, _ = model.encoder.forward_flat(b.feats, **b.encoder_inputs())
        grad = torch.ones_like(x)
        if x.requires_grad:
            with mode:
                x.backward(grad)
        del x, grad
        model.zero_grad(set_to_none=True)   # as every step ends: the next backward stores, not adds
    return summary(counter, len(with_feats))


def summary(counter: OpCounter, steps: int, top: int = 25) -> dict:
    """Per-step means (``per_step``: by phase, total, views), the pass's totals and the ``top``
    ops of the pass by calls."""
    tot = counter.totals()
    n = max(steps, 1)
    return {"steps": steps, "per_step": {k: v / n for k, v in tot.items()}, "pass": tot,
            "top_ops": dict(counter.merged().most_common(top))}
