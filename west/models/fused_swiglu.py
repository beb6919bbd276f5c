"""``model.llm.fused_swiglu``: a frozen SwiGLU MLP's elementwise work as one fused kernel each way.

Between its three products a Qwen2 MLP runs ``silu(gate) * up`` as two kernels in the forward
and four in the backward (``dh * up``, silu's gradient, ``silu(gate)``, ``dh * silu(gate)``),
each reading and writing tensors of tokens × intermediate size: 147 MB apiece for a pack of 8,192
at Qwen2-1.5B's 8,960. Fused, the forward reads gate and up once and writes the product, and the
backward reads dh, gate and up once and writes both gradients: 0.44 instead of 0.74 GB forward
and 0.74 instead of 1.62 GB backward per layer, by arithmetic. The functions below are that
arithmetic in float32, rounded once to the inputs' dtype; inductor (``torch.compile``, dynamic
shapes: one compilation for every batch size) turns each into one kernel, Triton on CUDA and C++
on a CPU, compiled on the first call. Numerically they are the stock operators up to bf16
rounding, slightly closer to exact (tests/test_models_fused_swiglu.py).

They run inside west.models.mlp_checkpoint.FrozenSwiGLU, which keeps gate and up (2 of the stock
3 intermediates) or, with ``checkpoint_scope: mlp``, only the MLP's input.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 at least (float64 stays)."""
    return t if t.dtype == torch.float64 else t.float()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, in float32 (or float64), rounded once."""
    return (F.silu(_wide(gate)) * _wide(up)).to(gate.dtype)


def swiglu_grads(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``silu(gate) * up`` for the output gradient ``dh``: (d gate, d up), in float32
    (or float64), each rounded once. silu'(g) = σ(g)·(1 + g·(1 − σ(g)))."""
    g, u, d = _wide(gate), _wide(up), _wide(dh)
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)


_compiled: dict[str, Callable] = {}


def fused(name: str) -> Callable:
    """:func:`silu_mul` or :func:`swiglu_grads` (``name``) compiled into one kernel, once per process.
    Inputs go in as 2-D rows, so that the batch's dimensions (1 for a pack, n for padded batches) do
    not specialise the compilation: one serves every shape of the same width."""
    if name not in _compiled:
        fn = {"silu_mul": silu_mul, "swiglu_grads": swiglu_grads}[name]
        compiled = torch.compile(fn, dynamic=True, fullgraph=True)

        def rows(*tensors: torch.Tensor):
            shape = tensors[0].shape
            # under a dispatch mode (the benchmark's FLOP and operator counters) dynamo compiles nothing:
            # the same arithmetic eagerly
            run = fn if is_in_torch_dispatch_mode() else compiled
            out = run(*(t.reshape(-1, shape[-1]) for t in tensors))
            return out.view(shape) if isinstance(out, torch.Tensor) else tuple(o.view(shape) for o in out)

        _compiled[name] = rows
    return _compiled[name]
