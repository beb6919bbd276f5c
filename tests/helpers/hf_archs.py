"""Tiny random configs of the causal-LM architectures west's packing is checked against, with
weights large enough that softcapping, windows and sinks change the result."""
from __future__ import annotations

from typing import Callable

import torch
import transformers as tf

VOCAB, PAD = 64, 0
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=1,
            initializer_range=0.2)


def _cfg(name: str, **kw) -> Callable:
    return lambda: getattr(tf, name)(**{**BASE, **kw})


ARCHS: dict[str, Callable] = {
    "llama": _cfg("LlamaConfig"),
    "qwen2": _cfg("Qwen2Config"),
    "qwen3": _cfg("Qwen3Config", head_dim=8),
    "mistral": _cfg("MistralConfig", sliding_window=None),
    "mistral_short_window": _cfg("MistralConfig", sliding_window=6),
    "mistral_long_window": _cfg("MistralConfig", sliding_window=4096),
    "gemma2": _cfg("Gemma2Config", head_dim=8, attn_logit_softcapping=2.0, query_pre_attn_scalar=1,
                   final_logit_softcapping=None,
                   sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "gemma2_full_softcap": _cfg("Gemma2Config", head_dim=8, attn_logit_softcapping=2.0, query_pre_attn_scalar=1,
                                final_logit_softcapping=None, layer_types=["full_attention", "full_attention"]),
    "gemma3": _cfg("Gemma3TextConfig", head_dim=8, query_pre_attn_scalar=1, sliding_window=6,
                   layer_types=["sliding_attention", "full_attention"]),
    "phi3": _cfg("Phi3Config", sliding_window=6),
    "olmo2": _cfg("Olmo2Config"),
    "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=256, pad_token_id=PAD,
                                         bos_token_id=1, eos_token_id=1, initializer_range=0.2),
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                  pad_token_id=PAD, bos_token_id=1, eos_token_id=1,
                                  initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_oss": _cfg("GptOssConfig", head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"]),
}


def tiny_model(arch: str, attn: str = "eager", seed: int = 0) -> torch.nn.Module:
    """The architecture's tiny random causal LM in float32 (the same weights for the same seed)."""
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(ARCHS[arch](), dtype=torch.float32, attn_implementation=attn)
    if arch == "gpt_oss":   # sinks start at zero: make them matter
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    return model.eval()
