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
* Packed layers with logit softcapping (``softcap``), attention sinks (``s_aux``) or a
  sliding window shorter than the longest segment run west.models.scored_attention (the
  window counted inside each segment); the others run :func:`varlen_attention`. A window
  at least as long as every segment changes nothing and is dropped.
* Without ``cu_seq_lens_q`` the call is delegated to transformers' own attention with
  transformers' own mask: SDPA, or the model's eager attention for softcapping and sinks.
  The mask builder skips only the plain causal mask without padding (SDPA's ``is_causal``;
  a packed row's full-attention layers never build a dense (L×L) mask); sliding-window
  masks are built as transformers builds them.
* Key/value heads arrive un-repeated (GQA); the backends handle the grouping.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from west.models.attention import BACKENDS, LazySegmentPlan, SegmentPlan, varlen_attention
from west.models.scored_attention import scored_segment_attention
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
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[2] != key.shape[2]:
        return _stock_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                                _strip_west(kwargs))
    if attention_mask is not None and not getattr(attention_mask, "west_no_padding", False):
        raise ValueError(f"{ATTN_NAME}: packed call got an attention mask; pass attention_mask=None with cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise ValueError(f"{ATTN_NAME}: self-attention needs cu_seq_lens_k == cu_seq_lens_q")
    b, hq, length, d = query.shape
    q = query.transpose(1, 2).reshape(b * length, hq, d)
    k = key.transpose(1, 2).reshape(b * length, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * length, value.shape[1], value.shape[-1])
    max_len = kwargs.get("max_length_q")
    max_len = int(max_len) if max_len is not None else length
    causal = bool(getattr(module, "is_causal", True))
    if sliding_window is not None and int(sliding_window) >= max_len:
        sliding_window = None   # no segment is longer than the window: it changes nothing
    plan = kwargs.get("west_segment_plan")
    if softcap is not None or sinks is not None or sliding_window is not None:
        if isinstance(plan, LazySegmentPlan):
            plan = plan.get(q.device)
        elif plan is None:
            plan = SegmentPlan.from_cu_seqlens(cu, device=q.device, buckets_per_octave=8)
        out = scored_segment_attention(q, k, v, plan, causal=causal, scale=scaling, dropout_p=dropout,
                                       softcap=softcap, window=sliding_window, sinks=sinks)
    else:
        out = varlen_attention(
            q, k, v, cu, max_len, causal=causal, scale=scaling, dropout_p=dropout,
            backend=kwargs.get("west_attn_backend") or "auto", plan=plan, keys=kwargs.get("west_key_rows"),
        )
    return out.view(b, -1, hq, out.shape[-1]), None   # -1, not length: one compiled graph for all lengths


def _stock_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, kwargs):
    """No segment boundaries (evaluation, generation, a padded batch): transformers' own attention
    with transformers' own mask. SDPA, except for layers with logit softcapping or attention sinks,
    which SDPA cannot compute: those run the model's own eager attention (an additive mask)."""
    if kwargs.get("softcap") is None and kwargs.get("s_aux") is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # heavy

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    eager = eager_attention_of(module)
    if attention_mask is None:   # plain causal (west_mask skips only that), aligned to the last key
        q_len, k_len = query.shape[2], key.shape[2]
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    out, _ = eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                   sliding_window=sliding_window, **kwargs)
    return out, None


def eager_attention_of(module: torch.nn.Module):
    """The ``eager_attention_forward`` of the modeling file that defines ``module``'s class."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise NotImplementedError(f"{ATTN_NAME}: {type(module).__name__} uses softcapping or attention sinks and its "
                                  "modeling file has no eager_attention_forward to compute them unpacked")
    return fn


def west_mask(*args, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """Mask builder: transformers' own SDPA mask, except None for a plain causal layer without
    padding (what SDPA's ``is_causal`` does anyway; a packed row's layers never build a dense mask).
    A sliding-window mask built without padding is marked, so that packed attention, which counts
    windows per segment itself, may ignore it."""
    from transformers.masking_utils import sdpa_mask  # heavy

    if attention_mask is None and kwargs.get("local_size") is None and not kwargs.get("use_vmap", False):
        return None
    mask = sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
    if mask is not None and attention_mask is None:
        mask.west_no_padding = True
    return mask


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
