"""Per-segment attention with the score terms that fused kernels do not all offer: logit
softcapping (Gemma2), attention sinks (GPT-OSS) and a sliding window counted inside each segment.

The scores of each group of equal-length segments of a :class:`west.models.attention.SegmentPlan`
are materialised (G, H, n, n), so the cost follows Σ len² like segment SDPA, and the arithmetic
is transformers' eager attention for these models: scores · scale, then ``tanh(s / cap) · cap``,
then the causal and window mask (a key is visible when ``query - key < window``), then a softmax
over the keys plus one sink logit per head that takes probability mass and is dropped. Every
device and dtype runs it; it is what west's packed attention uses for layers with any of these
terms, whichever backend the rest of the model uses.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from west.models.attention import SegmentPlan


def scored_segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SegmentPlan,
    causal: bool = True,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    softcap: Optional[float] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q (rows, Hq, D), k/v (rows, Hkv, D) -> (rows, Hq, Dv), each segment attending to itself.

    ``window``: a key is visible to a query when ``query - key < window`` (both inside the
    segment); ``sinks`` (Hq,): one extra logit per head in every softmax, its probability unused."""
    if q.shape[0] != plan.rows:
        raise ValueError(f"plan covers {plan.rows} rows, q has {q.shape[0]}")
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 token, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rep = q.shape[1] // k.shape[1]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for g in plan.groups:
        G, n = g.index.shape
        flat = g.index.reshape(-1)
        qg, kg, vg = (t.index_select(0, flat).view(G, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        if rep > 1:
            kg, vg = kg.repeat_interleave(rep, dim=1), vg.repeat_interleave(rep, dim=1)
        s = torch.matmul(qg, kg.transpose(-1, -2)) * scale                     # (G, H, n, n)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        pos = torch.arange(n, device=q.device)
        dist = pos[:, None] - pos[None, :]                                      # query - key
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device)
        if causal:
            allowed = dist >= 0
        if window is not None:
            allowed = allowed & (dist < window)
        allowed = allowed[None, None]
        if g.pad is not None:                                                   # padding keys: never visible
            allowed = allowed & g.valid[:, None, None, :]
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.to(s.dtype).view(1, -1, 1, 1).expand(G, -1, n, 1)
            both = torch.cat([s, sink], dim=-1)
            p = torch.softmax(both - both.amax(-1, keepdim=True), dim=-1, dtype=torch.float32)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1, dtype=torch.float32)
        p = p.to(vg.dtype)
        if dropout_p:
            p = F.dropout(p, p=dropout_p, training=True)
        og = torch.matmul(p, vg).transpose(1, 2).reshape(G * n, q.shape[1], v.shape[-1])
        keep = flat if g.valid is None else flat[g.valid.reshape(-1)]
        rows = og if g.valid is None else og[g.valid.reshape(-1)]
        out = out.index_copy(0, keep, rows)
    return out
