"""Restore a trained model for decoding: checkpoint, run config, tokenizer, device.

Which files hold what is west.checkpoint's business (restore.py); this module adds the
device and the data section decoding needs to build prompts exactly as in training.
"""
from __future__ import annotations

from typing import Optional

import torch

from west.checkpoint.restore import load_trained, read_run_config, resolve_checkpoint
from west.data.config import DataConfig
from west.host_memory import keep_freed_host_memory
from west.models.speech_llm import SpeechLLM
from west.ranks import disable_cudnn_attention, pick_device


def decode_device(requested: str = "auto") -> torch.device:
    """``pick_device`` with the error worded for west-decode's ``--device`` flag."""
    try:
        device = pick_device(requested)
    except RuntimeError:
        raise ValueError("--device cuda: CUDA is not available") from None
    if device.type == "cpu":
        keep_freed_host_memory()
    return device


def load_for_decoding(checkpoint: str, config: Optional[str] = None, device: str = "auto",
                      llm_path: Optional[str] = None) -> tuple[SpeechLLM, object, DataConfig]:
    """(model in eval mode on ``device``, tokenizer, DataConfig of training).

    Prompts must be built exactly as in training, so the data section comes from the run."""
    ckpt = resolve_checkpoint(checkpoint)
    raw = read_run_config(ckpt, config)
    dev = decode_device(device)
    model, tokenizer = load_trained(ckpt, raw, llm_path)
    # as the run trained: cuDNN's attention would build a graph for each new prompt and cache length
    disable_cudnn_attention()
    # The data section alone: the speech geometry is the model's (model.cfg.speech_shape()).
    return model.to(dev).eval(), tokenizer, DataConfig.from_dict(dict(raw.get("data") or {}))


def run_normalizer(checkpoint: str, config: Optional[str] = None) -> str:
    """The text normalizer the run scored its dev set with (``train.eval_normalizer``), "none"
    for a run or export that names none: west-decode's default for ``--normalizer``."""
    raw = read_run_config(resolve_checkpoint(checkpoint), config)
    return str((raw.get("train") or {}).get("eval_normalizer") or "none")
