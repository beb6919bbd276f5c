"""The phases of a training step, and where the host and the GPU are at each boundary, unprofiled.

:func:`phase_hooks` finds the boundaries: the model's forward, its encoder, projector and LLM
decoder, the gradients arriving at the decoder's output and input and at the encoder's output,
and the optimizer step. It uses hooks, so the production step runs unchanged. ``tools/profile_step.py``
opens profiler ranges there, the operator counter labels its counts, and :class:`StepClock` drops
marks there (``train.phase_marks`` in west-train, ``profile_step.py --phase_marks``);
west.train.phase_table turns the marks into tables.

Why marks: a profiler slows the host it measures (2.4x per step at the seed's shapes on an
H200), so the profiled trace cannot say which phases the host paces once the profiler is off.
A mark costs a clock read and, on CUDA, one event queued on the current stream. After the step
each mark says when the host reached it and when the GPU did. The difference, the *lag*, is how
much work the host had queued ahead. A lag near zero means the GPU had caught up and was waiting
for the host's next launch. A phase that ends with near-zero lag, and starts with near-zero lag,
is paced by the host. On a CPU the operators run as they are called: every lag is zero and the
table gives the host's time per phase.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

import torch

from west.train.phase_table import ENCODER_OUTPUT, LLM_INPUT, LLM_OUTPUT, phases


@contextlib.contextmanager
def phase_hooks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, enter: Callable[[str], None],
                leave: Callable[[str], None], grad: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Call ``enter(part)`` / ``leave(part)`` around the model's forward (``forward``), its
    ``forward/encoder``, ``forward/projector`` and ``forward/llm``, and the ``optimizer`` step; with
    ``grad``, also ``grad(point)`` when a gradient reaches a ``west.train.phase_table.GRAD_POINTS`` tensor (on
    autograd's thread). The encoder runs through ``forward_flat``, a method, which fires no module
    hooks: it is wrapped on the instance for the block."""
    def pre(name: str):
        return lambda *args: enter(name)

    def post(name: str, point: Optional[str] = None):
        def hook(module, args, output) -> None:
            leave(name)
            if point is not None:
                _on_grad(getattr(output, "last_hidden_state", output), point)
        return hook

    def _on_grad(t, point: str) -> None:
        if grad is not None and isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda g: grad(point))

    def llm_input(module, args, kwargs) -> None:
        enter("forward/llm")
        _on_grad(kwargs.get("inputs_embeds", args[0] if args else None), LLM_INPUT)

    decoder = model._base_llm().get_decoder() if hasattr(model, "_base_llm") else None
    handles = [model.register_forward_pre_hook(pre("forward")), model.register_forward_hook(post("forward"),
                                                                                            always_call=True)]
    if getattr(model, "projector", None) is not None:
        handles += [model.projector.register_forward_pre_hook(pre("forward/projector")),
                    model.projector.register_forward_hook(post("forward/projector"), always_call=True)]
    if decoder is not None:
        handles += [decoder.register_forward_pre_hook(llm_input, with_kwargs=True),
                    decoder.register_forward_hook(post("forward/llm", LLM_OUTPUT), always_call=True)]
    handles += [optimizer.register_step_pre_hook(pre("optimizer")),
                optimizer.register_step_post_hook(lambda *args: leave("optimizer"))]
    encoder = getattr(model, "encoder", None)
    if encoder is not None:
        inner = encoder.forward_flat

        def forward_flat(*args, **kwargs):
            enter("forward/encoder")
            try:
                out = inner(*args, **kwargs)
            finally:
                leave("forward/encoder")
            _on_grad(out[0], ENCODER_OUTPUT)
            return out
        encoder.forward_flat = forward_flat
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if encoder is not None:
            del encoder.forward_flat


class StepClock:
    """Marks at phase boundaries: the host's clock, and on CUDA an event on the current stream."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[str, float, Optional[torch.cuda.Event]]] = []
        self.last: list[dict] = []   # the phases of the step :meth:`around_step` marked last

    def mark(self, name: str) -> None:
        """A mark now. None while a CUDA graph is being captured (``train.encoder_graphs``' first step): a
        timing event has no place in a graph, and that step is not a steady one anyway."""
        event = None
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((name, time.perf_counter(), event))

    @contextlib.contextmanager
    def hooks(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        with phase_hooks(model, optimizer, self.mark, lambda part: self.mark("after " + part), self.mark):
            yield

    @contextlib.contextmanager
    def around_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Mark the step run in the block (hooks only meanwhile) and keep its phases in :attr:`last`.
        On CUDA this waits for the step's last kernels (the optimizer's, after the step's read-back)."""
        self.marks = []
        with self.hooks(model, optimizer):
            self.mark("step")
            yield
            self.mark("end")
        self.last = phases(self.read())

    def read(self) -> list[tuple[str, float, float]]:
        """(name, host ms, GPU ms) of every mark since the first, in the host's order; clears the marks.
        Waits for the last event. On a CPU the GPU column repeats the host's."""
        marks, self.marks = sorted(self.marks, key=lambda m: m[1]), []
        if not marks:
            return []
        if self.cuda:
            marks[-1][2].synchronize()
        h0, e0 = marks[0][1], marks[0][2]
        out = []
        for name, host, event in marks:
            ms = 1e3 * (host - h0)
            out.append((name, ms, e0.elapsed_time(event) if self.cuda else ms))
        return out
