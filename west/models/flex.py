"""FlexAttention over packed documents: one fused kernel per layer whatever the length spread.

A batch's :class:`DocumentMask` is built once on the host from Python lengths (no device
sync): the block-sparse structure of "a row sees only its own document" is known from the
boundaries alone, so the ``BlockMask`` is assembled directly (``BlockMask.from_kv_blocks``)
instead of evaluating a dense (rows x rows) mask, and its few tensors travel to the device
with non-blocking copies. Every layer of the encoder (or LLM) then reuses it.

:func:`rel_pos_attention` adds the Conformer's positional score term through a ``score_mod``
that reads a per-layer table of (query · position) products, so the fused kernel computes
exactly what west's segment SDPA computes with its additive bias (both ``pos_enc`` variants).

FlexAttention is compiled on CUDA (dynamic shapes). On the CPU torch runs it unfused and
forward-only: the CPU path of the Conformer stays segment SDPA, and tests compare the two.
"""
from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Callable, Optional, Sequence

import torch

from west.batch import to_device

BLOCK = 128   # FlexAttention's default block size (rows per tile)


class DocumentMask:
    """Which rows may attend to which, for documents laid end to end (rows 0..Σlen-1)."""

    def __init__(self, lengths: Sequence[int], device: torch.device | str, causal: bool = False,
                 block: int = BLOCK):
        lengths = [int(n) for n in lengths]
        if any(n < 0 for n in lengths):
            raise ValueError(f"document lengths must be >= 0, got {lengths}")
        self.lengths, self.rows, self.causal, self.block = lengths, sum(lengths), causal, block
        self.max_len = max(lengths, default=0)
        n_blocks = max(1, -(-self.rows // block))
        padded = n_blocks * block
        doc = torch.full((padded,), -1, dtype=torch.int64)       # rows past the end: no document
        pos = torch.zeros(padded, dtype=torch.int64)              # row's position inside its document
        start = 0
        for d, n in enumerate(lengths):
            doc[start:start + n] = d
            pos[start:start + n] = torch.arange(n)
            start += n
        self.doc = to_device(doc, device)
        self.pos = to_device(pos, device)
        self._device = torch.device(device)
        self._tables = document_blocks(lengths, block, causal)
        self._block_mask = None

    def block_mask(self):
        """The ``BlockMask`` (built on first use, then shared by every layer)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import BlockMask  # heavy

            doc, causal = self.doc, self.causal

            def mask_mod(b, h, q_idx, kv_idx):
                same = doc[q_idx] == doc[kv_idx]
                return same & (q_idx >= kv_idx) if causal else same

            if "seq_lengths" not in inspect.signature(BlockMask.from_kv_blocks).parameters:   # older torch
                from torch.nn.attention.flex_attention import create_block_mask  # heavy

                self._block_mask = create_block_mask(mask_mod, None, None, self.rows, self.rows, device=self._device)
                return self._block_mask
            kv_num, kv_idx, full_num, full_idx = (to_device(t, self._device) for t in self._tables)
            self._block_mask = BlockMask.from_kv_blocks(
                kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=self.block, mask_mod=mask_mod,
                seq_lengths=(self.rows, self.rows))
        return self._block_mask


def document_blocks(lengths: Sequence[int], block: int = BLOCK, causal: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), int32, shaped (1, 1, nb[, nb]):
    for each query tile, the key tiles it needs with the mask applied (partial) and those that
    are entirely allowed (full), from the document boundaries alone."""
    rows = sum(int(n) for n in lengths)
    nb = max(1, -(-rows // block))
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + int(n))
    cu = torch.tensor(bounds, dtype=torch.int64)
    partial = torch.zeros(nb, nb, dtype=torch.bool)
    full = torch.zeros(nb, nb, dtype=torch.bool)
    for i in range(nb):
        lo, hi = i * block, min((i + 1) * block, rows)
        if hi <= lo:
            continue
        d0 = int(torch.searchsorted(cu[1:], torch.tensor(lo), right=True))
        d1 = int(torch.searchsorted(cu[1:], torch.tensor(hi - 1), right=True))
        k_lo, k_hi = bounds[d0] // block, -(-bounds[d1 + 1] // block) - 1
        if causal:
            k_hi = min(k_hi, i)
        partial[i, k_lo:k_hi + 1] = True
        if d0 == d1:   # the query tile lies inside one document: its interior key tiles are full
            d_lo, d_hi = bounds[d0], bounds[d0 + 1]
            for j in range(k_lo, k_hi + 1):
                inside = d_lo <= j * block and (j + 1) * block <= d_hi and (j + 1) * block <= rows
                if inside and hi - lo == block and (not causal or j < i):
                    full[i, j] = True
    partial &= ~full
    return (*_to_indices(partial), *_to_indices(full))


def _to_indices(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (nb, nb) tile table -> (counts (1, 1, nb), ascending indices first (1, 1, nb, nb)) int32."""
    nb = table.shape[0]
    counts = table.sum(1).to(torch.int32)
    order = torch.argsort((~table).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return counts.view(1, 1, nb), order.view(1, 1, nb, nb)


@lru_cache(maxsize=None)
def _flex_fn(device_type: str) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention  # heavy

    if device_type == "cuda":   # unfused flex materialises scores; compiled it is one fused kernel
        return torch.compile(flex_attention, dynamic=True)
    return flex_attention


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask,
                   scale: Optional[float] = None, score_mod: Optional[Callable] = None) -> torch.Tensor:
    """q (rows, Hq, D), k/v (rows, Hkv, D) -> (rows, Hq, D), each row attending within its document."""
    if q.shape[0] != mask.rows:
        raise ValueError(f"document mask covers {mask.rows} rows, q has {q.shape[0]}")
    if not q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("FlexAttention has no backward on the CPU; use attn_backend 'sdpa_segments'")
    out = _flex_fn(q.device.type)(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], score_mod=score_mod,
        block_mask=mask.block_mask(), scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def rel_pos_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor,
                      pos_proj: torch.Tensor, mask: DocumentMask, scale: float,
                      key_positions: bool = False) -> torch.Tensor:
    """Conformer attention in one fused kernel: softmax(q·k·scale + qv·P(·)·scale) v per document.

    ``qv`` (rows, H, D) is the query plus ``pos_bias_v``; ``pos_proj`` (2m-1, H, D) the projected
    relative table (row m-1-r encodes distance r, m >= the longest document). The positional
    term is qv_i·P[m-1-(i-j)] (``relative``) or qv_i·P[m-1-j] with j the key's position in its
    document (``key_positions``, WeNet's rel_pos), the same arithmetic as segment SDPA's bias."""
    m = (pos_proj.shape[0] + 1) // 2
    if m < mask.max_len:
        raise ValueError(f"positional table covers length {m}, the longest document is {mask.max_len}")
    # the kernel runs whole tiles: give the rows past the end a (zero) table row to read
    qv = torch.nn.functional.pad(qv, (0, 0, 0, 0, 0, mask.doc.shape[0] - qv.shape[0]))
    if key_positions:   # column t: P[m-1-t], t = key position 0..m-1
        table = torch.einsum("rhd,thd->hrt", qv, pos_proj[:m].flip(0)) * scale
        pos = mask.pos

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx, pos[kv_idx]]
    else:               # column c = m-1-(i-j) for distance i-j; other documents' pairs are masked
        table = torch.einsum("rhd,chd->hrc", qv, pos_proj) * scale
        last = table.shape[-1] - 1
        centre = torch.full((), m - 1, dtype=torch.int64, device=q.device)   # a tensor: no recompile per m

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx, (centre - q_idx + kv_idx).clamp(0, last)]
    return flex_attention(q, k, v, mask, scale=scale, score_mod=score_mod)


def rel_pos_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor, pos_proj: torch.Tensor,
                      lengths: Sequence[int], scale: float, key_positions: bool = False) -> torch.Tensor:
    """Dense per-document attention with the same positional term as :func:`rel_pos_attention`,
    in the inputs' dtype (tests use float64): the reference both fused and segment paths meet."""
    m = (pos_proj.shape[0] + 1) // 2
    out, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        i = torch.arange(n, device=q.device)
        table_rows = m - 1 - i[None, :].expand(n, n) if key_positions else m - 1 - (i[:, None] - i[None, :])
        s = torch.einsum("qhd,khd->hqk", q[rows], k[rows])
        s = s + torch.einsum("qhd,qkhd->hqk", qv[rows], pos_proj[table_rows])
        out.append(torch.einsum("hqk,khd->qhd", (s * scale).softmax(-1), v[rows]))
        start += n
    return torch.cat(out)
