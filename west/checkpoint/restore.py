"""A trained model back from disk for decoding or export: which checkpoint, which config, which weights.

A checkpoint is a training checkpoint (``DIR/checkpoints/step_N``, or a run DIR meaning its
latest one), read with the run's ``DIR/config.yaml`` (a lean one also reads the base LLM at
``model.llm.path`` and its adapters from ``CKPT/adapter``), or a
:mod:`west.checkpoint.pretrained` directory (``west_model.json``: ``save_speech_llm`` or
``west-export``). Training's own resume goes through west.checkpoint.training.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import yaml

from west.checkpoint.base_llm import BaseLLM
from west.checkpoint.integrity import find_latest
from west.checkpoint.model_state import load_model_weights
from west.checkpoint.pretrained import CONFIG_FILE, LLM_DIR, load_speech_llm
from west.checkpoint.training import read_meta
from west.models.config import SpeechLLMConfig
from west.models.encoders import release_of
from west.models.llm import load_llm, load_tokenizer
from west.models.speech_llm import SpeechLLM


def released_type(path: Path) -> Optional[str]:
    """The registry's name for a released speech LLM's directory (west-export of such a run), else None."""
    conf = path / "config.json"
    if not conf.is_file():
        return None
    try:
        model_type = json.loads(conf.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError):
        return None
    release = release_of(model_type)
    return release.name if release is not None else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step dir or an export (west's or a released model's format) as given, or the latest
    checkpoint of a run dir."""
    p = Path(path)
    if (p / "meta.json").is_file() or (p / CONFIG_FILE).is_file() or released_type(p):
        return p
    latest = find_latest(p / "checkpoints")
    if latest is None:
        raise FileNotFoundError(f"--checkpoint {path}: neither a checkpoint, an export, nor a run dir with one")
    return latest


def config_candidates(ckpt: Path, config: Optional[str] = None) -> list[Path]:
    """Where the run's config.yaml is: given, next to an export, or two levels above a step dir."""
    return [Path(config)] if config else [ckpt / "config.yaml", ckpt.parent.parent / "config.yaml"]


def read_run_config(ckpt: Path, config: Optional[str] = None) -> dict:
    """The run's resolved config.yaml (the first of :func:`config_candidates` that exists), or {}."""
    for c in config_candidates(ckpt, config):
        if c.is_file():
            with open(c, encoding="utf-8") as f:
                raw = yaml.safe_load(f) or {}
            if not isinstance(raw, dict):
                raise ValueError(f"{c}: not a west config (top level must be a mapping of sections)")
            return raw
    if config:
        raise FileNotFoundError(f"--config: no such file: {config}")
    return {}


def build_from_run(model_section: dict, weights: bool = False,
                   llm_path: Optional[str] = None) -> tuple[SpeechLLM, object]:
    """(SpeechLLM shaped like the run's model, its tokenizer), from the run config's model section.

    The LLM's architecture comes from ``model.llm.path`` (``llm_path`` when given: the base
    moved since training); its weights are read there only with ``weights`` (a lean checkpoint
    refers to them), else every weight is loaded from the checkpoint by the caller."""
    from transformers import AutoConfig  # heavy

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
    return SpeechLLM(model_cfg, llm=llm), load_tokenizer(model_cfg.llm.path)


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


def load_released(ckpt: Path, model_section: dict) -> tuple[SpeechLLM, object]:
    """A released-format directory (its every weight, adapters merged) as ``model.type`` of its
    kind with ``model.path`` the directory; the run's model section gives the rest (dtype,
    attention, pad_to_30s) without the keys the directory now fixes (paths, projector, LoRA)."""
    section = {k: v for k, v in model_section.items() if k not in ("type", "path", "projector", "lora")}
    section["encoder"] = {k: v for k, v in (section.get("encoder") or {}).items() if k not in ("type", "path")}
    section["llm"] = {k: v for k, v in (section.get("llm") or {}).items() if k != "path"}
    model_cfg = SpeechLLMConfig.from_dict({**section, "type": released_type(ckpt), "path": str(ckpt)})
    model_cfg.derive()
    return SpeechLLM(model_cfg), load_tokenizer(ckpt)


def load_trained(ckpt: Path, run_config: dict, llm_path: Optional[str] = None) -> tuple[SpeechLLM, object]:
    """(model, tokenizer) from a resolved checkpoint of any kind, on the CPU in train mode."""
    if released_type(ckpt):
        return load_released(ckpt, run_config.get("model") or {})
    if (ckpt / CONFIG_FILE).is_file():
        model = load_speech_llm(ckpt, llm_path=llm_path)
        has_tokenizer = (ckpt / LLM_DIR / "tokenizer_config.json").is_file()
        tok_dir = ckpt / LLM_DIR if has_tokenizer else (llm_path or model.cfg.llm.path)
        return model, load_tokenizer(tok_dir)
    if "model" not in run_config and "model" not in read_meta(ckpt):
        raise FileNotFoundError(f"{ckpt}: no config.yaml with a model section next to the run "
                                "(give --config DIR/config.yaml)")
    return load_training_checkpoint(ckpt, run_config.get("model") or {}, llm_path)
