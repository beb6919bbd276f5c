"""Conformer encoder that is exact under packing.

Blocks follow WeNet/ESPnet: macaron feed-forwards (½-step each), relative-position
self-attention (Transformer-XL style with ``pos_bias_u``/``pos_bias_v``), a
convolution module (pointwise → GLU → depthwise → LayerNorm → Swish → pointwise)
and a final LayerNorm; pre-norm everywhere.

Activations stay flat (rows, D) in both modes; a :class:`FrameLayout` says where
utterances are, so nothing crosses an utterance boundary:
* attention runs per utterance (``segment_sdpa`` with the rel-pos term as an
  additive bias; relative positions i−j are per utterance by construction);
* the depthwise convolution reads zeros beyond each utterance's edges;
* subsampling uses an aligned zero-gap layout (see subsampling.py);
* all normalisation is LayerNorm (per frame), never batch statistics.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from west.batch import to_device
from west.models.attention import SegmentGroup, auto_backend, bucket_length, segment_sdpa, varlen_attention
from west.models.config import ConformerConfig
from west.models.flex import rel_pos_attention
from west.models.layout import FlatEncoder, FrameLayout, gather_rows
from west.models.precision import autocast_dtype
from west.models.subsampling import Conv2dSubsampling
from west.shapes import SpeechShape


def relative_sinusoids(max_len: int, dim: int) -> torch.Tensor:
    """(2*max_len-1, dim) sinusoidal encodings of relative positions max_len-1 … -(max_len-1).

    Row ``max_len-1-r`` encodes distance r = i − j; it does not depend on max_len, so a
    segment of length n uses the centre slice [max_len-n, max_len+n-1)."""
    r = torch.arange(max_len - 1, -max_len, -1, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(2 * max_len - 1, dim)
    pe[:, 0::2] = torch.sin(r * div)
    pe[:, 1::2] = torch.cos(r * div)
    return pe


class RelPositionAttention(nn.Module):
    """scores = ((q+u)·k + (q+v)·W_pos·pe(i−j)) / √d_k, per utterance; with ``pos_enc="wenet"``
    the positional term is (q+v)·W_pos·pe(j), j the key's position in its utterance (WeNet's
    rel_pos attention has no rel_shift)."""

    def __init__(self, d_model: int, num_heads: int, attn_dropout: float = 0.0, pos_enc: str = "relative",
                 backend: str = "auto"):
        super().__init__()
        self.key_positions = pos_enc == "wenet"
        self.backend = backend
        self.h, self.dk = num_heads, d_model // num_heads
        self.linear_q = nn.Linear(d_model, d_model)
        self.linear_k = nn.Linear(d_model, d_model)
        self.linear_v = nn.Linear(d_model, d_model)
        self.linear_out = nn.Linear(d_model, d_model)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(self.h, self.dk))
        self.pos_bias_v = nn.Parameter(torch.empty(self.h, self.dk))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)
        self.attn_dropout = attn_dropout

    def route(self, x: torch.Tensor, layout: FrameLayout) -> str:
        """The attention this batch runs (:func:`encoder_backend`), for ``x`` in this mode and precision:
        what the layout was prepared for (once per batch, outside compiled blocks), else decided here."""
        if layout.attention is not None:
            return layout.attention
        dropout = self.attn_dropout if self.training else 0.0
        return encoder_backend(self.backend, x.device, layout.packed, dropout, self.key_positions,
                               autocast_dtype(x) or x.dtype)

    def positional(self, layout: FrameLayout, table: torch.Tensor, route: str) -> torch.Tensor:
        """What :meth:`forward` reads as ``pos`` for this batch: the relative table
        (:func:`relative_sinusoids`), or, for key positions outside flex, the sinusoid of each
        attention row's position in its utterance (rows of the table), built once per batch."""
        if not self.key_positions or route == "flex":
            return table
        m = (table.shape[0] + 1) // 2
        positions = layout.positions(grouped=route == "sdpa_segments")
        return table.index_select(0, (m - 1) - positions)   # row m-1-j of the table encodes +j

    def forward(self, x: torch.Tensor, layout: FrameLayout, pos: torch.Tensor) -> torch.Tensor:
        dropout = self.attn_dropout if self.training else 0.0
        route = self.route(x, layout)
        plan = layout.plan if route == "sdpa_segments" else None
        if plan is not None and layout.packed:   # packed rows into their attention groups, once
            rows_index, place, plan = layout.grouped()
            x = gather_rows(x, rows_index, place)
        rows = x.shape[0]
        q = self.linear_q(x).view(rows, self.h, self.dk)
        k = self.linear_k(x).view(rows, self.h, self.dk)
        v = self.linear_v(x).view(rows, self.h, self.dk)
        scale = self.dk ** -0.5
        if self.key_positions and route != "flex":
            out = self._key_position_attention(q, k, v, pos, layout, plan, route, dropout, scale)
        else:
            out = self._relative_attention(q, k, v, pos, layout, plan, route == "flex", dropout, scale)
        return self.linear_out(out.flatten(1))   # no Python row count: one compiled graph for all lengths

    def _key_position_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                                layout: FrameLayout, plan, route: str, dropout: float, scale: float) -> torch.Tensor:
        """WeNet's term (q+v)·W_pos·pe(j) depends on the key alone, so the scores are one dot product
        over 2·dk, [q+u, q+v]·[k, W_pos·pe(j)], with no bias: ``pos`` holds each row's pe(j). Any
        kernel then runs it: segment SDPA, or one that takes cu_seqlens over the packed rows (no
        gather, no padding). v gets dk zeros (kernels want one head size), dropped after."""
        dt = k.dtype   # autocast's: the linear layers' output
        pk = self.linear_pos(pos).view(-1, self.h, self.dk).to(dt)
        qa = torch.cat([q + self.pos_bias_u.to(dt), q + self.pos_bias_v.to(dt)], dim=-1)
        ka = torch.cat([k, pk], dim=-1)
        va = F.pad(v, (0, self.dk))
        if route == "sdpa_segments":
            out = segment_sdpa(qa, ka, va, plan, causal=False, scale=scale, dropout_p=dropout)
        else:
            out = varlen_attention(qa, ka, va, layout.cu_seqlens(), layout.max_len, causal=False, scale=scale,
                                   dropout_p=dropout, backend=route)
        return out[..., : self.dk]

    def _relative_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_table: torch.Tensor,
                            layout: FrameLayout, plan, flex: bool, dropout: float, scale: float) -> torch.Tensor:
        """Transformer-XL's term (q+v)·W_pos·pe(i−j) (or WeNet's under flex) as a score bias: segment
        SDPA adds it per group, FlexAttention's score_mod reads it from the projected table."""
        m = (pos_table.shape[0] + 1) // 2
        p = self.linear_pos(pos_table).view(-1, self.h, self.dk)     # (2m-1, h, dk)

        def rel_bias(q_u: torch.Tensor, group: SegmentGroup) -> torch.Tensor:
            g, n = q_u.shape[0], q_u.shape[2]
            qg = q_u + (self.pos_bias_v - self.pos_bias_u)[:, None, :]   # (G, h, n, dk): q + v
            pn = p[m - n: m + n - 1].permute(1, 2, 0)                  # (h, dk, 2n-1)
            full = torch.matmul(qg, pn).contiguous()   # (G, h, n, 2n-1), fresh: storage offset 0
            # out[i, j] = full[i, (n-1) - i + j]  (relative distance i - j): a strided view.
            w = 2 * n - 1
            bd = full.as_strided((g, self.h, n, n), (self.h * n * w, n * w, w - 1, 1), n - 1)
            return bd * scale

        if flex:
            return rel_pos_attention(q + self.pos_bias_u, k, v, q + self.pos_bias_v, p, layout.doc_mask(), scale,
                                     key_positions=self.key_positions)
        return segment_sdpa(q + self.pos_bias_u, k, v, plan, causal=False, scale=scale, dropout_p=dropout,
                            bias_fn=rel_bias)


def encoder_backend(requested: str, device: torch.device, packed: bool, dropout: float = 0.0,
                    key_positions: bool = False, dtype: torch.dtype = torch.float32) -> str:
    """What the Conformer's attention runs:

    * ``sdpa_segments``: segment SDPA (a padded batch is one group); ``auto``'s choice, except:
    * ``flash`` / ``torch_varlen``: packed rows with ``pos_enc: wenet`` under ``auto`` where a
      cu_seqlens kernel runs (CUDA, fp16/bf16: flash-attn, else torch's; the LLM's choice,
      west.models.varlen_kernels.choose_backend): WeNet's term folds into q and k
      (:meth:`RelPositionAttention._key_position_attention`), so one kernel per layer, no gather,
      no padding. ``varlen`` asks for it anywhere (flash-attn, or its torch reference off CUDA;
      with attention dropout only where flash-attn runs);
    * ``flex``: FlexAttention for packed rows where asked for (on CUDA, or a forward without
      gradients on the CPU; never with dropout). Not ``auto``'s: on one H100 at the seed's
      sizes, one group ran the layer's attention 2x faster than flex with its rel-pos
      ``score_mod`` (docs/benchmarks.md, tools/check_encoder_attention.py)."""
    if requested == "flex":
        if packed and not dropout and (device.type == "cuda" or not torch.is_grad_enabled()):
            return "flex"
        return "sdpa_segments"
    if key_positions and packed and requested in ("auto", "varlen"):
        kernel = auto_backend(device, dtype, dropout > 0)
        if kernel in ("flash", "torch_varlen"):
            return kernel
        if requested == "varlen" and not dropout:   # its torch reference off CUDA has no dropout
            return "flash"
    return "sdpa_segments"


def attention_grouping(cfg: ConformerConfig, device: torch.device) -> Optional[int]:
    """``buckets_per_octave`` for packed segment SDPA: under ``auto`` on CUDA, one group (a fixed
    number of kernels per layer whatever the length spread: launches cost more than the padding
    FLOPs there); elsewhere the configured grouping (on a CPU, FLOPs are the cost)."""
    return 0 if cfg.attn_backend == "auto" and device.type == "cuda" else cfg.buckets_per_octave


class ConvModule(nn.Module):
    """WeNet's convolution module; its output goes through the block's dropout alone, as WeNet's does."""

    def __init__(self, d_model: int, kernel: int):
        super().__init__()
        self.pad = (kernel - 1) // 2
        self.pointwise1 = nn.Linear(d_model, 2 * d_model)
        self.depthwise = nn.Conv1d(d_model, d_model, kernel, groups=d_model, padding=0)
        self.norm = nn.LayerNorm(d_model)
        self.pointwise2 = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, layout: FrameLayout) -> torch.Tensor:
        y = self._depthwise(F.glu(self.pointwise1(x), dim=-1), layout)
        return self.pointwise2(F.silu(self.norm(y)))

    def _depthwise(self, y: torch.Tensor, layout: FrameLayout) -> torch.Tensor:
        """Per-utterance zero-padded depthwise convolution over the flat rows."""
        return layout.convolve(y, self.depthwise)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, ffn_dim), nn.SiLU(), nn.Dropout(dropout),
                                 nn.Linear(ffn_dim, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConformerBlock(nn.Module):
    def __init__(self, cfg: ConformerConfig):
        super().__init__()
        d = cfg.d_model
        self.ff1, self.ff2 = FeedForward(d, cfg.ffn_dim, cfg.dropout), FeedForward(d, cfg.ffn_dim, cfg.dropout)
        self.attn = RelPositionAttention(d, cfg.num_heads, cfg.attn_dropout, cfg.pos_enc, cfg.attn_backend)
        self.conv = ConvModule(d, cfg.conv_kernel)
        self.norm_ff1, self.norm_attn, self.norm_conv, self.norm_ff2, self.norm_out = (
            nn.LayerNorm(d) for _ in range(5))
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, layout: FrameLayout, pos: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.dropout(self.ff1(self.norm_ff1(x)))
        x = x + self.dropout(self.attn(self.norm_attn(x), layout, pos))
        x = x + self.dropout(self.conv(self.norm_conv(x), layout))
        x = x + 0.5 * self.dropout(self.ff2(self.norm_ff2(x)))
        return self.norm_out(x)


class ConformerEncoder(FlatEncoder):
    """fbank feats -> encoder frames, padded ``(N, T, F)+lengths`` or packed ``(ΣT, F)+cu_seqlens``."""

    def __init__(self, cfg: ConformerConfig):
        super().__init__()
        self.cfg = cfg
        self.subsampling = Conv2dSubsampling(cfg.input_dim, cfg.d_model, cfg.subsampling_rate, cfg.dropout)
        self.blocks = nn.ModuleList(ConformerBlock(cfg) for _ in range(cfg.num_blocks))
        self.after_norm = nn.LayerNorm(cfg.d_model)
        self.gradient_checkpointing = cfg.gradient_checkpointing
        self._pos: Optional[torch.Tensor] = None
        self.static_blocks = None   # west.models.static_encoder.StaticBlocks (train.encoder_graphs): not a module

    @classmethod
    def from_config(cls, cfg: ConformerConfig, attn_backend: str = "auto") -> "ConformerEncoder":
        return cls(cfg)   # its attention backend is model.encoder.attn_backend

    @classmethod
    def speech_shape(cls, cfg: ConformerConfig, projector_stride: int) -> SpeechShape:
        return SpeechShape(cfg.subsampling_rate, projector_stride, num_mel_bins=cfg.input_dim)

    @classmethod
    def num_layers(cls, cfg: ConformerConfig) -> int:
        return cfg.num_blocks

    def freeze_blocks(self, n: int) -> None:
        """The subsampling and the first ``n`` blocks: a pretrained encoder's low blocks keep their acoustics."""
        if n > len(self.blocks):
            raise ValueError(f"model.freeze_encoder_blocks {n} > the encoder's {len(self.blocks)} blocks")
        if n > 0:
            self.subsampling.requires_grad_(False)
            for block in self.blocks[:n]:
                block.requires_grad_(False)

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    @property
    def attention_buckets(self) -> Optional[int]:
        return attention_grouping(self.cfg, self.after_norm.weight.device)

    @property
    def output_dim(self) -> int:
        return self.cfg.d_model

    def _pos_table(self, m: int, ref: torch.Tensor) -> torch.Tensor:
        """Rows for distances m-1 … -(m-1), from a table kept on ``ref``'s device (built on the host
        once, and again only when a longer utterance arrives)."""
        if self._pos is None or (self._pos.shape[0] + 1) // 2 < m or self._pos.device != ref.device:
            longest = max(m, 512, (self._pos.shape[0] + 1) // 2 if self._pos is not None else 0)
            self._pos = to_device(relative_sinusoids(longest, self.cfg.d_model), ref.device)
        full_m = (self._pos.shape[0] + 1) // 2
        return self._pos[full_m - m: full_m + m - 1].to(dtype=ref.dtype)

    def encode(self, feats: torch.Tensor, lens: list[int], packed: bool) -> tuple[torch.Tensor, FrameLayout]:
        """Checked feats (FlatEncoder.forward_flat) -> flat rows in the input's layout, and that layout."""
        buckets = attention_grouping(self.cfg, feats.device)
        if packed:
            x, layout = self.subsampling.forward_packed(feats, lens, buckets)
        else:
            x, layout = self.subsampling.forward_padded(feats, lens)
        pos = None
        if self.blocks:   # plans built once here, outside any compiled block, then shared by all blocks
            attn = self.blocks[0].attn
            route = attn.route(x, layout)
            if self.static_blocks is not None and self.training and torch.is_grad_enabled():
                y = self.static_blocks(x, layout, route)   # train.encoder_graphs; None: eager below
                if y is not None:
                    return self.after_norm(y), layout
            longest = (bucket_length(max(layout.lengths), buckets, max(layout.lengths)) if layout.packed
                       else layout.padded_len)   # the longest group segment SDPA forms (flex needs <= this)
            layout.prepare(self.blocks[0].conv.pad, route)
            pos = attn.positional(layout, self._pos_table(longest, x), route)
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(block, x, layout, pos, use_reentrant=False)
            else:
                x = block(x, layout, pos)
        return self.after_norm(x), layout
