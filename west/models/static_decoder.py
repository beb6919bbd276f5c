"""The frozen LLM decoder at one shape for a whole run, so that one CUDA graph captured at the start
can replay it every step (``train.cuda_graphs``; the capture is west.train.cuda_graphs).

A packed row of T <= P tokens in n segments, the longest at most M, is padded to exactly P tokens
and S segment boundaries: the padding tokens are zeros in segments of their own, each at most M
long, with positions restarting per segment, and the unused slots are empty segments at the end.
Real tokens compute exactly what they computed unpadded: attention stays inside each segment,
positions are their own, everything else works row by row. A row that does not fit (T > P, a
segment longer than M, more than S segments, a batch of several rows) runs unpadded, eagerly, and
is counted by reason.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from west.batch import to_device

# decoder(embeds (1, L, d), position_ids (1, L), cu_seqlens (k,) on the device, its host copy or None,
# max_seqlen) -> last hidden state (1, L, d)
Decoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[int]], torch.Tensor]


@dataclass(frozen=True)
class StaticShape:
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


def padding_positions(total: int, shape: StaticShape) -> torch.Tensor:
    """Positions of the padding tokens after ``total`` real ones: 0.. restarting every M."""
    return torch.arange(shape.tokens - total) % shape.max_seqlen


class StaticDecoder:
    """Runs ``decoder`` on packed rows padded to ``shape``; ``replay`` (set by the capture) replaces
    the eager call on padded rows with the captured graph. ``counts``: rows run padded ("static")
    and rows that did not fit, by reason ("eager: <reason>")."""

    def __init__(self, decoder: Decoder, shape: StaticShape):
        self.decoder, self.shape = decoder, shape
        self.replay: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None
        self.counts: Counter = Counter()

    def __call__(self, embeds: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                 host_cu: torch.Tensor, max_seqlen: Optional[int]) -> torch.Tensor:
        padded = padded_cu_seqlens(host_cu, self.shape) if embeds.shape[0] == 1 else "rows"
        if isinstance(padded, str):
            self.counts[f"eager: {padded}"] += 1
            return self.decoder(embeds, position_ids, cu_seqlens, host_cu, max_seqlen)
        self.counts["static"] += 1
        total, dev = embeds.shape[1], embeds.device
        e = torch.cat([embeds, embeds.new_zeros(1, self.shape.tokens - total, embeds.shape[2])], dim=1)
        pad_pos = to_device(padding_positions(total, self.shape).to(position_ids.dtype), dev)
        pos = torch.cat([position_ids.reshape(1, -1), pad_pos.reshape(1, -1)], dim=1)
        cu = to_device(padded, dev)
        if self.replay is not None:
            hidden = self.replay(e, pos, cu)
        else:
            hidden = self.decoder(e, pos, cu, padded, self.shape.max_seqlen)
        return hidden[:, :total]

    def sample_inputs(self, hidden_size: int, dtype: torch.dtype, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A row of padding only, at the static shape: what a capture warms up and records with."""
        cu = padded_cu_seqlens(torch.zeros(1, dtype=torch.int32), self.shape)
        assert isinstance(cu, torch.Tensor)   # an empty row always fits (StaticShape checks it)
        embeds = torch.zeros(1, self.shape.tokens, hidden_size, dtype=dtype, device=device, requires_grad=True)
        pos = padding_positions(0, self.shape).reshape(1, -1).to(device)
        return embeds, pos, cu.to(device)

    def summary(self) -> str:
        """"N LLM rows replayed at P tokens, M unpadded (reason k, ...)" for the run's last line."""
        return graph_summary(self.counts, self.replay is not None, "LLM rows", f"{self.shape.tokens} tokens")


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
