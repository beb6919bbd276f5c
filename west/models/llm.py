"""The causal LLM: a stock Hugging Face model loaded by path or config, optionally with LoRA."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from west.models.config import LLMConfig, LoraSettings
from west.models.hf_attention import ATTN_NAME, register


def load_llm(cfg: LLMConfig, hf_config=None) -> nn.Module:
    """Stock ``AutoModelForCausalLM``: from ``cfg.path`` (from_pretrained), else from a config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.attn_implementation == ATTN_NAME:
        register()
    kw = dict(attn_implementation=cfg.attn_implementation, dtype=getattr(torch, cfg.dtype))
    if hf_config is not None:
        return AutoModelForCausalLM.from_config(hf_config, **kw)
    if cfg.path:
        if not Path(cfg.path).is_dir():
            raise FileNotFoundError(f"model.llm.path {cfg.path!r} is not a directory")
        return AutoModelForCausalLM.from_pretrained(cfg.path, **kw)
    if cfg.config:
        conf = dict(cfg.config)
        model_type = conf.pop("model_type", None)
        if model_type is None:
            raise ValueError("model.llm.config needs a 'model_type' (e.g. qwen2)")
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **conf), **kw)
    raise ValueError("model.llm needs either 'path' (local HF dir) or 'config' (HF config dict)")


def apply_lora(llm: nn.Module, lora: LoraSettings) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # optional extra
        raise ImportError("model.lora needs peft: pip install 'west[lora]'") from e
    conf = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(llm, conf)
