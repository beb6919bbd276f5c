"""Restore a trained model for decoding: checkpoint, run config, tokenizer.

A checkpoint is either a training checkpoint (``DIR/checkpoints/step_N``, or a
run DIR meaning its latest one), read with the run's ``DIR/config.yaml`` (a lean one
also reads the base LLM at ``model.llm.path`` and its adapters from ``CKPT/adapter``),
or a ``SpeechLLM.save_pretrained`` / ``west-export`` directory (``west_model.json``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import yaml

from west.data.config import DataConfig
from west.host_memory import keep_freed_host_memory
from west.models.config import SpeechLLMConfig
from west.models.llm import load_llm
from west.models.saved import CONFIG_FILE, LLM_DIR
from west.models.speech_llm import SpeechLLM
from west.train.checkpoint import find_latest, read_meta
from west.train.distributed import pick_device
from west.train.lean import BaseLLM, load_model_weights


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step dir or an export as given, or the latest checkpoint of a run dir."""
    p = Path(path)
    if (p / "meta.json").is_file() or (p / CONFIG_FILE).is_file():
        return p
    latest = find_latest(p / "checkpoints")
    if latest is None:
        raise FileNotFoundError(f"--checkpoint {path}: neither a checkpoint, an export, nor a run dir with one")
    return latest


def read_run_config(ckpt: Path, config: Optional[str] = None) -> dict:
    """The run's resolved config.yaml: given, next to an export, or two levels above a step dir."""
    candidates = [Path(config)] if config else [ckpt / "config.yaml", ckpt.parent.parent / "config.yaml"]
    for c in candidates:
        if c.is_file():
            with open(c, encoding="utf-8") as f:
                raw = yaml.safe_load(f) or {}
            if not isinstance(raw, dict):
                raise ValueError(f"{c}: not a west config (top level must be a mapping of sections)")
            return raw
    if config:
        raise FileNotFoundError(f"--config: no such file: {config}")
    return {}


def decode_device(requested: str = "auto") -> torch.device:
    """``pick_device`` with the error worded for west-decode's ``--device`` flag."""
    try:
        device = pick_device(requested)
    except RuntimeError:
        raise ValueError("--device cuda: CUDA is not available") from None
    if device.type == "cpu":
        keep_freed_host_memory()
    return device


def build_from_run(model_section: dict, weights: bool = False,
                   llm_path: Optional[str] = None) -> tuple[SpeechLLM, object]:
    """(SpeechLLM shaped like the run's model, its tokenizer), from the run config's model section.

    The LLM's architecture comes from ``model.llm.path`` (``llm_path`` when given: the base
    moved since training); its weights are read there only with ``weights`` (a lean checkpoint
    refers to them), else every weight is loaded from the checkpoint by the caller."""
    from transformers import AutoConfig, AutoTokenizer

    model_cfg = SpeechLLMConfig.from_dict(model_section)
    if llm_path:
        model_cfg.llm.path = str(llm_path)
    if not model_cfg.llm.path:
        raise ValueError("model.llm.path is empty in the run config: the tokenizer cannot be loaded")
    if not Path(model_cfg.llm.path).is_dir():
        raise FileNotFoundError(f"model.llm.path {model_cfg.llm.path!r} (the base LLM) is not a directory; "
                                "give --llm_path DIR where it is now")
    hf_config = None if weights else AutoConfig.from_pretrained(model_cfg.llm.path)
    llm = load_llm(model_cfg.llm, hf_config=hf_config)
    return SpeechLLM(model_cfg, llm=llm), AutoTokenizer.from_pretrained(str(model_cfg.llm.path))


def load_training_checkpoint(ckpt: Path, model_section: dict,
                             llm_path: Optional[str] = None) -> tuple[SpeechLLM, object]:
    """(model with the checkpoint's weights, tokenizer). A lean checkpoint's frozen base LLM
    is read from the run's ``model.llm.path`` (or ``llm_path``) after its fingerprint is
    checked against meta.json; LoRA adapters come from ``CKPT/adapter``."""
    meta = read_meta(ckpt)
    referenced = bool(meta.get("base_llm"))
    # The model section the checkpoint was trained with wins over the run's config.yaml, which a
    # later (e.g. refused) launch in the same dir may have replaced; older checkpoints lack it.
    model_section = meta.get("model") or model_section
    model, tokenizer = build_from_run(model_section, weights=referenced, llm_path=llm_path)
    base = BaseLLM(model.cfg.llm.path) if referenced else None
    model.load_state_dict(load_model_weights(ckpt, meta, model, base), strict=not referenced)
    return model, tokenizer


def load_for_decoding(checkpoint: str, config: Optional[str] = None, device: str = "auto",
                      llm_path: Optional[str] = None) -> tuple[SpeechLLM, object, DataConfig]:
    """(model in eval mode on ``device``, tokenizer, DataConfig of training).

    Prompts must be built exactly as in training, so the data section comes from the run."""
    from transformers import AutoTokenizer

    ckpt = resolve_checkpoint(checkpoint)
    raw = read_run_config(ckpt, config)
    dev = decode_device(device)
    if (ckpt / CONFIG_FILE).is_file():  # save_pretrained export
        model = SpeechLLM.from_pretrained(ckpt)
        tok_dir = ckpt / LLM_DIR if (ckpt / LLM_DIR / "tokenizer_config.json").is_file() else model.cfg.llm.path
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    else:
        if "model" not in raw and "model" not in read_meta(ckpt):
            raise FileNotFoundError(f"{ckpt}: no config.yaml with a model section next to the run "
                                    "(give --config DIR/config.yaml)")
        model, tokenizer = load_training_checkpoint(ckpt, raw.get("model") or {}, llm_path)
    # The data section alone: the speech geometry is the model's (model.cfg.speech_shape()).
    return model.to(dev).eval(), tokenizer, DataConfig.from_dict(dict(raw.get("data") or {}))
