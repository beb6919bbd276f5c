"""Attention for pack rows whose samples share one prompt prefix (``data.shared_prefix``).

Every ASR sample starts with the same tokens before its speech: the system turn and the user
turn's header (14 tokens of Qwen2-Instruct's default template, about 15 % of an AIShell
sample). With ``data.shared_prefix`` a pack row holds them once, at its start, and each sample
without them (west.data.policies). Queries stay one segment per sample; a sample's keys are the
row's prefix followed by its own tokens, gathered into a key tensor with boundaries of its own,
and the causal mask is aligned bottom-right (flash-attn's convention: query j of a segment with
``e`` more keys than queries sees keys 0..j+e). Positions are unchanged (the sample's tokens keep
P, P+1, ...), so each sample computes exactly what it computes with the prefix in front of it,
while the prefix's rows are computed once per row instead of once per sample.

:class:`KeyRows` is that key layout, built on the host by the collator; :func:`keyed_sdpa` is
the CPU path (segments of similar length batched into one SDPA call each, as segment SDPA does);
the CUDA kernels (flash-attn, torch's varlen) take the two sets of boundaries directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from west.batch import host_to_device
from west.models.buckets import bucket_length


@dataclass
class KeyGroup:
    size: int                     # G segments, each with n queries and e + n keys (padded)
    n: int
    e: int
    keep: torch.Tensor            # (G, 1, n, e + n) bool: key visible to query


@dataclass
class KeyedPlan:
    groups: list
    q_rows: torch.Tensor          # every group's query rows, concatenated (pads repeat a real row)
    k_rows: torch.Tensor          # every group's key rows in the flat (ungathered) tensor, concatenated
    inverse: torch.Tensor         # each query row's row in the concatenated group outputs


@dataclass
class KeyRows:
    """Where each segment's keys come from: ``index`` (rows_k,) int64, the flat row of every key
    in segment order (``host_index`` on the host); ``cu_seqlens`` int32 boundaries over those keys
    (the query boundaries' segments, each as long or longer; ``host_cu_seqlens`` on the host)."""
    index: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    host_index: torch.Tensor
    host_cu_seqlens: torch.Tensor
    _plans: dict = field(default_factory=dict, repr=False)

    def plan(self, host_cu_q: torch.Tensor, device: torch.device, causal: bool,
             buckets_per_octave: Optional[int] = 8) -> KeyedPlan:
        """The CPU path's groups, built once per batch (every layer shares them)."""
        key = (causal, str(device))
        if key not in self._plans:
            self._plans[key] = keyed_plan(host_cu_q, self.host_cu_seqlens, self.host_index, device, causal,
                                          buckets_per_octave)
        return self._plans[key]


def prefix_row(prefix: int, lengths: list[int], device: torch.device | str = "cpu") -> tuple[torch.Tensor, KeyRows]:
    """(query boundaries, key rows) of one row [prefix | samples], every sample attending to the
    prefix (the layout west.data.policies.collate_packed gives a full row): for kernel checks."""
    cu_q = np.cumsum([0, prefix, *lengths])
    rows = [np.arange(prefix)] + [np.concatenate([np.arange(prefix), np.arange(a, b)])
                                  for a, b in zip(cu_q[1:-1], cu_q[2:])]
    index = np.concatenate(rows).astype(np.int64)
    cu_k = np.cumsum([0, *(r.size for r in rows)]).astype(np.int32)
    host_index, host_cu = torch.from_numpy(index), torch.from_numpy(cu_k)
    keys = KeyRows(host_to_device(index, device), host_to_device(cu_k, device), int(np.diff(cu_k).max()),
                   host_index, host_cu)
    return host_to_device(cu_q.astype(np.int32), device), keys


def keyed_plan(host_cu_q: torch.Tensor, host_cu_k: torch.Tensor, host_index: torch.Tensor, device: torch.device,
               causal: bool, buckets_per_octave: Optional[int] = 8) -> KeyedPlan:
    """Segments grouped by (bucketed query length, extra keys): one SDPA call per group, its rows
    gathered once for all groups (one backward buffer, as segment SDPA does)."""
    cq, ck = (np.asarray(t.detach().to("cpu", torch.int64)) for t in (host_cu_q, host_cu_k))
    flat_k = np.asarray(host_index.detach().to("cpu", torch.int64))
    if cq.shape != ck.shape:
        raise ValueError(f"{cq.shape[0] - 1} query segments but {ck.shape[0] - 1} key segments")
    lq, lk = np.diff(cq), np.diff(ck)
    if (lk < lq).any():
        raise ValueError("a segment has fewer keys than queries: keys are its prefix and its own rows")
    longest = int(lq.max(initial=0))
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i in np.flatnonzero(lq > 0):
        n = bucket_length(int(lq[i]), buckets_per_octave, longest)
        by_shape.setdefault((n, int(lk[i] - lq[i])), []).append(int(i))
    groups, q_rows, k_rows, rows, places, offset = [], [], [], [], [], 0
    for (n, e), segs in sorted(by_shape.items()):
        s = np.array(segs)
        j, t = np.arange(n), np.arange(e + n)
        q_valid = j[None, :] < lq[s][:, None]
        k_valid = t[None, :] < lk[s][:, None]
        q_index = cq[s][:, None] + np.where(q_valid, j[None, :], 0)
        keep = np.repeat(k_valid[:, None, :], n, axis=1)
        if causal:
            keep = keep & (t[None, None, :] <= j[None, :, None] + e)
        groups.append(KeyGroup(len(s), n, e, host_to_device(keep[:, None], device)))
        q_rows.append(q_index.reshape(-1))
        k_rows.append(flat_k[ck[s][:, None] + np.where(k_valid, t[None, :], 0)].reshape(-1))
        rows.append(q_index[q_valid])
        places.append(np.flatnonzero(q_valid) + offset)
        offset += q_index.size
    inverse = np.zeros(int(cq[-1]), np.int64)
    if not groups:   # no row in any segment
        empty = host_to_device(np.zeros(0, np.int64), device)
        return KeyedPlan([], empty, empty, host_to_device(inverse, device))
    inverse[np.concatenate(rows)] = np.concatenate(places)
    return KeyedPlan(groups, host_to_device(np.concatenate(q_rows), device),
                     host_to_device(np.concatenate(k_rows), device), host_to_device(inverse, device))


def keyed_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: KeyedPlan,
               scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """q (rows, Hq, D) and k/v (rows, Hkv, D) in the flat row order; each query segment against its
    key rows (:func:`keyed_plan`) -> (rows, Hq, D). The query segments cover every row."""
    gqa = q.shape[1] != k.shape[1]
    if not plan.groups:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    q_all = q.index_select(0, plan.q_rows)
    k_all, v_all = k.index_select(0, plan.k_rows), v.index_select(0, plan.k_rows)
    q_parts = q_all.split([g.size * g.n for g in plan.groups])
    k_sizes = [g.size * (g.e + g.n) for g in plan.groups]
    parts = []
    for g, qs, ks, vs in zip(plan.groups, q_parts, k_all.split(k_sizes), v_all.split(k_sizes)):
        qg = qs.view(g.size, g.n, *qs.shape[1:]).transpose(1, 2)                     # (G, Hq, n, D)
        kg, vg = (x.view(g.size, g.e + g.n, *x.shape[1:]).transpose(1, 2) for x in (ks, vs))
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.keep, dropout_p=dropout_p, scale=scale,
                                            enable_gqa=gqa)
        parts.append(og.transpose(1, 2).reshape(-1, og.shape[1], og.shape[-1]))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.index_select(0, plan.inverse)
