"""west's attention inside stock Hugging Face models, without forking model code.

``register()`` adds ``ATTN_NAME`` ("west_varlen") to ``transformers.AttentionInterface``
(the attention kernel) and to ``AttentionMaskInterface`` (the mask builder); the
model is then loaded with ``attn_implementation=ATTN_NAME``.

How the pieces meet (transformers 5.x, probed):
* Keyword arguments given to ``model(...)`` reach every attention call unchanged, so
  packed batches pass the standard flash-attn names ``cu_seq_lens_q/k``,
  ``max_length_q/k`` (see :func:`packed_kwargs`) plus a (lazily built)
  :class:`SegmentPlan` under ``west_segment_plan`` and the backend name under
  ``west_attn_backend``. With them, attention runs per segment.
* Without ``cu_seq_lens_q`` the call is delegated to transformers' own SDPA
  function. The mask builder returns None when there is no 2-D padding mask
  (plain causal: exact for right-padded rows' real tokens, and no dense
  (L×L) mask is ever built for a packed row), and otherwise builds the usual
  SDPA padding mask (right-padded training, left-padded batched generation).
* Key/value heads arrive un-repeated (GQA); the backends handle the grouping.
"""
from __future__ import annotations

from typing import Optional

import torch

from west.models.attention import BACKENDS, LazySegmentPlan, SegmentPlan, varlen_attention
from west.models.shared_prefix import KeyRows

ATTN_NAME = "west_varlen"
_registered = False


def west_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: query (B, Hq, L, D), key/value (B, Hkv, L, D) -> (B, L, Hq, D)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[2] != key.shape[2]:
        # Not packed (or decoding with a KV cache): stock SDPA with whatever mask was built.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # heavy

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **_strip_west(kwargs),
        )
    if sliding_window is not None:
        raise NotImplementedError(f"{ATTN_NAME}: sliding-window layers are not supported in packed mode")
    if attention_mask is not None:
        raise ValueError(f"{ATTN_NAME}: packed call got an attention mask; pass attention_mask=None with cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise ValueError(f"{ATTN_NAME}: self-attention needs cu_seq_lens_k == cu_seq_lens_q")
    b, hq, length, d = query.shape
    q = query.transpose(1, 2).reshape(b * length, hq, d)
    k = key.transpose(1, 2).reshape(b * length, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * length, value.shape[1], value.shape[-1])
    max_len = kwargs.get("max_length_q")
    out = varlen_attention(
        q, k, v, cu, int(max_len) if max_len is not None else length,
        causal=bool(getattr(module, "is_causal", True)),
        scale=scaling, dropout_p=dropout,
        backend=kwargs.get("west_attn_backend") or "auto",
        plan=kwargs.get("west_segment_plan"),
        keys=kwargs.get("west_key_rows"),
    )
    return out.view(b, -1, hq, out.shape[-1]), None   # -1, not length: one compiled graph for all lengths


def west_mask(*args, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """Mask builder: None without a 2-D padding mask (causal / packed), else the SDPA mask."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask  # heavy

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register ``ATTN_NAME`` with transformers (idempotent); returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface  # heavy
        from transformers.masking_utils import AttentionMaskInterface  # heavy

        AttentionInterface.register(ATTN_NAME, west_attention)
        AttentionMaskInterface.register(ATTN_NAME, west_mask)
        _registered = True
    return ATTN_NAME


def packed_kwargs(
    cu_seqlens: torch.Tensor,
    max_seqlen: Optional[int] = None,
    backend: str = "auto",
    plan: Optional[SegmentPlan | LazySegmentPlan] = None,
    west_extras: bool = True,
    host_cu_seqlens: Optional[torch.Tensor] = None,
    keys: Optional[KeyRows] = None,
) -> dict:
    """Keyword arguments for ``model(...)`` on a packed row (R=1, position_ids restart per segment).

    The standard names also drive transformers' own flash_attention_2 path; eager/sdpa
    ignore them and fall back to position-id packing detection (exact with use_cache=False).
    ``west_extras`` adds the (lazily built) plan and backend (only for ``ATTN_NAME``), from
    ``host_cu_seqlens`` (the CPU copy of ``cu_seqlens``; without it they are read back from
    the device, a sync). ``keys``: each segment's key rows where a row's samples share a prompt
    prefix (west.models.shared_prefix; west's attention only)."""
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    host = host_cu_seqlens if host_cu_seqlens is not None else cu_seqlens
    if max_seqlen is None:
        max_seqlen = int(torch.diff(host).max())
    kw = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
              max_length_q=int(max_seqlen), max_length_k=int(max_seqlen))
    if west_extras:
        if plan is None and backend in ("auto", "sdpa_segments", "flex"):
            plan = LazySegmentPlan(host, buckets_per_octave=8)
        kw.update(west_segment_plan=plan, west_attn_backend=backend)
        if keys is not None:
            kw["west_key_rows"] = keys
    elif keys is not None:
        raise ValueError("a shared prefix's key rows need west's attention (model.llm.attn_implementation "
                         f"{ATTN_NAME})")
    return kw


def _strip_west(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if not k.startswith("west_")}
