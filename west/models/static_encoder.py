"""The Conformer's blocks at one shape for a whole run, so that one CUDA graph captured at the start
can replay their forward and backward every step (``train.encoder_graphs``; the capture is
west.train.encoder_graphs).

The encoder is where a packed step's host is slowest to feed the GPU: twelve trainable blocks of
small kernels (d_model 256 at the seed's shapes), each shorter on the GPU than its launch on the
host. Replayed from a graph, the blocks cost the host two launches per step.

A pack's R encoder rows in n utterances are padded to exactly P rows and S segment boundaries
(:class:`StaticShape`, :func:`padded_cu_seqlens`): padding rows are zeros in segments of their own,
each at most M long, and unused slots are empty segments.
Every block keeps utterances apart (attention per segment, the convolution's zero gaps, everything
else row by row), so the real rows compute what they computed unpadded, and the padding rows get
no gradient. Only the cu_seqlens kernel route (``pos_enc: wenet``, packed rows) runs here; a
batch on another route, or one that does not fit (R > P, an utterance longer than M, more than S
segments), runs its blocks eagerly and is counted by reason.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np
import torch
from torch import nn

from west.batch import host_to_device, to_device
from west.models.layout import FrameLayout


@dataclass(frozen=True)
class StaticShape:
    """One packed row's shape for a whole run: real rows padded to it replay one captured graph."""
    tokens: int       # P: every packed row is padded to this many LLM positions
    segments: int     # S: cu_seqlens always has S + 1 entries
    max_seqlen: int   # M: the kernels' longest-segment bound, the same every step

    def __post_init__(self) -> None:
        if min(self.tokens, self.segments, self.max_seqlen) < 1:
            raise ValueError(f"static shape needs positive sizes, got {self}")
        if self.segments < math.ceil(self.tokens / self.max_seqlen):
            raise ValueError(f"{self.segments} segments cannot hold {self.tokens} padding tokens in segments "
                             f"of at most {self.max_seqlen}")


def padded_cu_seqlens(host_cu: torch.Tensor, shape: StaticShape) -> Union[torch.Tensor, str]:
    """int32 (S + 1,) boundaries of the row padded to ``shape``, or why it does not fit
    ("tokens", "max_seqlen" or "segments")."""
    total, n = int(host_cu[-1]), host_cu.numel() - 1
    if total > shape.tokens:
        return "tokens"
    if n and int(torch.diff(host_cu).max()) > shape.max_seqlen:
        return "max_seqlen"
    pad = shape.tokens - total
    ends = list(range(total + shape.max_seqlen, shape.tokens, shape.max_seqlen)) + ([shape.tokens] if pad else [])
    if n + len(ends) > shape.segments:
        return "segments"
    fill = [shape.tokens] * (shape.segments - n - len(ends))
    return torch.cat([host_cu.to(torch.int32), torch.tensor(ends + fill, dtype=torch.int32)])


def graph_summary(counts: Counter, replayed: bool, what: str, size: str, real_pct: Optional[float] = None) -> str:
    """"N <what> replayed at <size>, M unpadded (reason k, ...)" from counts of "static" and
    "eager: <reason>" (or "padded (eager)" where nothing was captured); with ``real_pct``, the
    percentage of the padded rows that were real after the size ("(85 % of them real)"): what the
    padding costs, since a padding row costs the replay what a real one does."""
    eager = {k.split(": ", 1)[1]: v for k, v in counts.items() if k.startswith("eager")}
    why = f" ({', '.join(f'{k} {v}' for k, v in sorted(eager.items()))})" if eager else ""
    how = "replayed" if replayed else "padded (eager)"
    real = f" ({real_pct:.0f} % of them real)" if real_pct is not None else ""
    return f"{counts['static']} {what} {how} at {size}{real}, {sum(eager.values())} unpadded{why}"


KERNEL_ROUTES = ("flash", "torch_varlen")


class FixedLayout(FrameLayout):
    """A packed layout given by its device tensors alone, at the static shape: what the blocks read
    on the kernel route (the boundaries, the longest-segment bound, the convolution's gap index).
    Its utterances' lengths stay on the host, with :class:`StaticBlocks`."""

    def __init__(self, cu: torch.Tensor, gap_dst: torch.Tensor, gap_size: torch.Tensor, pad: int,
                 max_len: int, attention: str):
        super().__init__([gap_dst.shape[0]], cu.device)   # one segment of all rows: never read
        self.lengths = []
        self.max_len, self.attention, self._cu = max_len, attention, cu
        self._gap_cache[pad] = (gap_dst, gap_size)

    def _gap_index(self, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        if pad not in self._gap_cache:
            raise ValueError(f"a fixed layout holds the gap index for pad {list(self._gap_cache)}, not {pad}")
        return self._gap_cache[pad]


class BlockStack(nn.Module):
    """The encoder's blocks as one module of tensors only, what a graph captures: (x, pos, cu,
    gap_dst) at the static shape -> x after every block. Holds the encoder's own blocks (not a
    copy); it is not registered in the model, so checkpoints and optimizers never see it twice."""

    def __init__(self, blocks: nn.ModuleList, shape: StaticShape, pad: int, route: str):
        super().__init__()
        self.blocks, self.shape, self.pad, self.route = blocks, shape, pad, route
        self.autocast: Optional[torch.dtype] = None   # set by a capture: autocast inside the graph

    def gap_size(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape.tokens + self.pad * (self.shape.segments - 1), 0, device=device)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, gap_dst: torch.Tensor) -> torch.Tensor:
        layout = FixedLayout(cu, gap_dst, self.gap_size(x.device), self.pad, self.shape.max_seqlen, self.route)
        cast = (torch.autocast(device_type=x.device.type, dtype=self.autocast, cache_enabled=False)
                if self.autocast is not None else contextlib.nullcontext())
        with cast:
            for block in self.blocks:
                x = block(x, layout, pos)
        return x


class StaticBlocks:
    """Runs an encoder's blocks on packed rows padded to ``shape``; ``replay`` (set by the capture)
    replaces the eager stack with the captured graphs. ``counts``: batches run padded ("static")
    and batches that did not fit, by reason ("eager: <reason>")."""

    def __init__(self, encoder: nn.Module, shape: StaticShape, route: str):
        if route not in KERNEL_ROUTES:
            raise ValueError(f"static encoder blocks run the cu_seqlens kernel route {KERNEL_ROUTES}, not {route!r}")
        self.encoder, self.shape = encoder, shape
        self.stack = BlockStack(encoder.blocks, shape, encoder.blocks[0].conv.pad, route)
        self.replay: Optional[Callable[..., torch.Tensor]] = None
        self.counts: Counter = Counter()
        self.real_rows = 0   # of the batches run padded: rows before the padding
        self.trainable = [p for p in self.stack.parameters() if p.requires_grad]

    def inputs(self, x: torch.Tensor, lengths: list[int]) -> tuple | str:
        """(x, pos, cu, gap_dst) padded to the static shape, or why the batch does not fit."""
        host_cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
        padded = padded_cu_seqlens(host_cu, self.shape)
        if isinstance(padded, str):
            return padded
        rows, total, dev = self.shape.tokens, x.shape[0], x.device
        seg = np.diff(padded.numpy()).astype(np.int64)
        starts = np.repeat(np.cumsum(seg) - seg, seg)
        positions = np.arange(rows) - starts   # restarting per segment, padding's included
        gap_dst = np.arange(rows) + self.stack.pad * np.repeat(np.arange(self.shape.segments), seg)
        table = self.encoder._pos_table(self.shape.max_seqlen, x)
        m = (table.shape[0] + 1) // 2
        pos = table.index_select(0, host_to_device((m - 1) - positions, dev))   # row m-1-j encodes +j
        x = torch.cat([x, x.new_zeros(rows - total, x.shape[1])])
        return x, pos, to_device(padded, dev), host_to_device(gap_dst, dev)

    def __call__(self, x: torch.Tensor, layout: FrameLayout, route: str) -> Optional[torch.Tensor]:
        """The blocks' output on the real rows of ``x`` (packed, ``layout``), or None where the
        batch runs eagerly (counted)."""
        if not layout.packed or route != self.stack.route:
            self.counts[f"eager: route {route if layout.packed else 'padded'}"] += 1
            return None
        args = self.inputs(x, layout.lengths)
        if isinstance(args, str):
            self.counts[f"eager: {args}"] += 1
            return None
        if self.replay is not None and any(p.grad is not None for p in self.trainable):
            raise RuntimeError("train.encoder_graphs: the encoder's blocks still hold gradients; the graph's "
                               "backward hands autograd its own gradient memory, which this replay would "
                               "overwrite: one backward per optimizer step, then zero_grad(set_to_none=True)")
        self.counts["static"] += 1
        self.real_rows += x.shape[0]
        out = self.replay(*args) if self.replay is not None else self.stack(*args)
        return out[: x.shape[0]]

    def sample_inputs(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Rows of padding only, at the static shape: what a capture warms up and records with
        (``x`` requires grad, as the subsampling's output does)."""
        x = torch.zeros(1, self.encoder.output_dim, dtype=dtype, device=device)
        padded = self.inputs(x, [1])
        assert not isinstance(padded, str)   # one frame always fits (StaticShape checks the padding)
        x0, pos, cu, gap_dst = padded
        return x0.detach().requires_grad_(True), pos.detach(), cu, gap_dst

    def summary(self) -> str:
        """"N encoder batches replayed at P rows (r % of them real), M unpadded (reason k, ...)" for the
        run's last line."""
        padded = self.counts["static"] * self.shape.tokens
        return graph_summary(self.counts, self.replay is not None, "encoder batches", f"{self.shape.tokens} rows",
                             100 * self.real_rows / padded if padded else None)
