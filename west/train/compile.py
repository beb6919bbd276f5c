"""``train.compile``: regional ``torch.compile`` of the model's repeated blocks.

Each Conformer block (or Whisper layer) and each LLM decoder layer has its ``forward``
compiled in place, so identical blocks share one compiled graph, compile time stays that
of one block, and state-dict names are unchanged (checkpoints load either way). Kernels
that take ``cu_seqlens`` (torch's varlen op, flash-attn) are traced into the graphs, and so is
segment SDPA over one group (a padded batch, or the packed Conformer under ``auto`` on CUDA),
so such a Conformer block is one graph; segment SDPA over several length groups stays outside
(``torch.compiler.disable``: its Python loops would specialise per batch); FlexAttention in the
packed Conformer is traced into its block.

Pack rows change length from batch to batch: after the first new shape dynamo marks the
changing sizes dynamic (``dynamic=None``, torch's default), so a run compiles each block
about twice, not once per batch. :func:`compilations` reports how many graphs were built.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


def compile_regions(model: nn.Module) -> int:
    """Compile the repeated blocks of ``model`` (``model.fsdp_units()``: the units FSDP shards one
    by one) in place; returns how many were wrapped."""
    import torch  # heavy

    blocks = regions(model)
    for block in blocks:
        block.forward = torch.compile(block.forward)
    return len(blocks)


@contextlib.contextmanager
def compiled_regions(model: nn.Module) -> Iterator[int]:
    """:func:`compile_regions` for a while (the benchmark's timed passes), then the blocks' own
    ``forward`` again, so that operator and FLOP counters, which trace eager code, see the same
    model before and after. Yields how many blocks were compiled."""
    blocks = regions(model)
    if any("forward" in vars(b) for b in blocks):
        raise ValueError("train.compile: the blocks are compiled already")
    n = compile_regions(model)
    try:
        yield n
    finally:
        for block in blocks:
            del block.forward   # the instance's compiled wrapper: the class's forward again


def regions(model: nn.Module) -> list[nn.Module]:
    """The blocks ``train.compile`` compiles."""
    units = getattr(model, "fsdp_units", None)
    if units is None:
        raise ValueError(f"train.compile: {type(model).__name__} lists no repeated blocks (fsdp_units())")
    return list(units())


def compilations() -> int:
    """Graphs dynamo captured in this process so far (a recompilation counts again; a frame split
    by a graph break counts each part)."""
    from torch._dynamo.utils import counters  # heavy

    return int(counters["stats"]["unique_graphs"])
