"""What west's packed attention computes exactly, checked on the model before any data is read.

West's attention replaces a model's attention per segment of a packed row. Logit softcapping,
attention sinks and sliding windows (per segment) are computed; settings that need something
else (attention chunks, bidirectional attention, recurrent or linear-attention layers, an
encoder-decoder, position biases inside attention such as ALiBi, a class that does not call
transformers' AttentionInterface) are refused here, naming the setting, so that nothing trains
on wrong numbers. ``EXACT`` lists the model types whose packed step is tested equal to the
unpacked step (tests/test_hf_archs.py); others are allowed with a warning.
"""
from __future__ import annotations

import warnings

import torch

from west.models.hf_attention import eager_attention_of

# model type -> what its packed attention exercises (docs/packing.md prints this table)
EXACT = {
    "llama": "causal", "qwen2": "causal", "qwen3": "causal, q/k norms", "mistral": "sliding window per segment",
    "gemma2": "softcap, sliding and full layers", "gemma3_text": "sliding and full layers",
    "phi3": "sliding window per segment", "olmo2": "causal, q/k norms", "gpt_neox": "partial rotary",
    "gpt2": "learned positions", "gpt_oss": "attention sinks, sliding and full layers",
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot train on packed rows with west's attention, or None."""
    cls = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{cls} does not route its attention through transformers' AttentionInterface "
                "(_supports_attention_backend is False): west's attention would never be called")
    configs = [model.config]
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text is not None and text is not model.config:
        configs.append(text)
    for c in configs:
        if getattr(c, "is_encoder_decoder", False):
            return "config.is_encoder_decoder=True: packing covers decoder-only causal LMs"
        if getattr(c, "attention_chunk_size", None):
            return (f"config.attention_chunk_size={c.attention_chunk_size}: chunked attention is not computed "
                    "per segment")
        if getattr(c, "use_bidirectional_attention", False) or getattr(c, "is_causal", True) is False:
            return "config.use_bidirectional_attention / is_causal: packed attention is causal"
        if getattr(c, "alibi", False) or getattr(c, "position_embedding_type", None) in ("alibi", "relative_key",
                                                                                          "relative_key_query"):
            return "config.alibi / position_embedding_type: a position bias inside attention is not computed"
        others = sorted({t for t in getattr(c, "layer_types", None) or [] if t not in LAYER_TYPES})
        if others:
            return (f"config.layer_types has {others}: only {list(LAYER_TYPES)} layers are computed per "
                    "segment (recurrent or linear-attention layers would carry state across samples)")
    for name, module in model.named_modules():
        needs_eager = getattr(module, "attn_logit_softcapping", None) is not None or \
            isinstance(getattr(module, "sinks", None), torch.Tensor)
        if needs_eager:
            try:
                eager_attention_of(module)
            except NotImplementedError as e:
                return f"{name}: {e}"
    return None


def check_packable(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` naming the setting when west cannot train ``model`` on packed rows
    exactly; warn when its type is not among the tested ones."""
    why = refusal(model)
    if why is not None:
        raise ValueError(f"west packing refuses {type(model).__name__}: {why}")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in EXACT:
        warnings.warn(f"west packing: model type {model_type!r} is not among those whose packed step is tested "
                      f"equal to the unpacked step ({', '.join(sorted(EXACT))}); compare a step before relying "
                      "on it", stacklevel=3)
