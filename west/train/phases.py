"""The phases of a training step, found by hooks so that the production step runs unchanged:
the model's forward, its encoder, projector and LLM decoder, the gradients arriving at the
decoder's output and input and at the encoder's output, and the optimizer step. The operator
counter labels its counts with them; the lab's phase marks and profiles time them
(west.lab.phase_marks). torch is imported only where a hook runs, so the tables that name the
phases load without it."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Optional

if TYPE_CHECKING:
    import torch

# Where the gradient hooks mark, by the tensor whose gradient arrived.
LLM_OUTPUT, LLM_INPUT, ENCODER_OUTPUT = GRAD_POINTS = ("llm output", "llm input", "encoder output")


@contextlib.contextmanager
def phase_hooks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, enter: Callable[[str], None],
                leave: Callable[[str], None], grad: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Call ``enter(part)`` / ``leave(part)`` around the model's forward (``forward``), its
    ``forward/encoder``, ``forward/projector`` and ``forward/llm``, and the ``optimizer`` step; with
    ``grad``, also ``grad(point)`` when a gradient reaches a :data:`GRAD_POINTS` tensor (on
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
        import torch  # heavy; a hook runs where torch is loaded anyway

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
