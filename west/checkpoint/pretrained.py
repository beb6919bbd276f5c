"""A trained SpeechLLM as a directory: west config, the LLM's HF config (+ tokenizer), weights.

``DIR/west_model.json`` (the model section), ``DIR/llm/`` (config.json, generation config,
tokenizer), ``DIR/model.safetensors`` (west.checkpoint.files: tied tensors once). Its
``llm_weights`` metadata says where the LLM's weights are:

* ``included``: all in ``model.safetensors``;
* ``referenced``: the frozen LLM's are left out and read from ``model.llm.path``, whose files
  must match the fingerprint recorded beside (west.checkpoint.base_llm, as training checkpoints);
* ``llm_dir``: written by :func:`export_speech_llm`, the LLM is a complete Hugging Face model in
  ``DIR/llm`` (LoRA merged, loadable by ``AutoModelForCausalLM.from_pretrained(DIR/llm)``).

``path`` (the frozen LLM by path without a fingerprint) is no longer written; directories that
have it still load, with a warning that the base could not be checked.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from west.checkpoint.base_llm import BaseLLM, check_base
from west.checkpoint.files import load_tensors, save_tensors, tensors_metadata
from west.models.config import SpeechLLMConfig
from west.models.llm import load_llm
from west.models.speech_llm import SpeechLLM

CONFIG_FILE = "west_model.json"
WEIGHTS_FILE = "model.safetensors"
LLM_DIR = "llm"


def save_speech_llm(model: SpeechLLM, out_dir: str | Path, tokenizer=None, include_frozen_llm: bool = True) -> Path:
    """Write west config, the LLM's HF config (+ tokenizer) and the weights.

    ``include_frozen_llm=False`` leaves out the LLM's frozen weights: they are read again from
    ``model.llm.path``, checked against the fingerprint written here (small files for a frozen
    1.5B LLM, never a silently different base)."""
    out = Path(out_dir)
    if not include_frozen_llm and not model.cfg.llm.path:
        raise ValueError("include_frozen_llm=False needs model.llm.path to reload the LLM from")
    (out / LLM_DIR).mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=2))
    base = model._base_llm()
    base.config.save_pretrained(out / LLM_DIR)
    base.generation_config.save_pretrained(out / LLM_DIR)
    if tokenizer is not None:
        tokenizer.save_pretrained(out / LLM_DIR)
    meta = {"llm_weights": "included"}
    skip: set[str] = set()
    if not include_frozen_llm:
        skip = _frozen_llm_names(model)
        meta = {"llm_weights": "referenced", "base_llm": json.dumps(BaseLLM(model.cfg.llm.path).reference())}
    save_tensors({n: t for n, t in model.state_dict().items() if n not in skip}, out / WEIGHTS_FILE, meta)
    return out


def load_speech_llm(path: str | Path, device: str | torch.device = "cpu", llm_path: Optional[str] = None) -> SpeechLLM:
    """Inverse of :func:`save_speech_llm` and :func:`export_speech_llm`. ``llm_path``: where the
    referenced base LLM is now, if it moved since the directory was written."""
    from transformers import AutoConfig  # heavy

    path = Path(path)
    cfg = SpeechLLMConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
    meta = tensors_metadata(path / WEIGHTS_FILE)
    mode = meta.get("llm_weights", "included")
    if llm_path:
        cfg.llm.path = str(llm_path)
    if mode == "included":
        llm = load_llm(cfg.llm, hf_config=AutoConfig.from_pretrained(path / LLM_DIR))
    elif mode == "llm_dir":  # an export: the LLM is the full HF model in DIR/llm
        cfg.llm.path = str(path / LLM_DIR)
        llm = load_llm(cfg.llm)
    elif mode in ("referenced", "path"):
        if mode == "referenced":
            check_base(path, {"base_llm": json.loads(meta["base_llm"])}, BaseLLM(str(cfg.llm.path)))
        else:
            warnings.warn(f"{path}: written without the base LLM's fingerprint; its frozen weights are read "
                          f"from {cfg.llm.path} unchecked (save it again to record one)", stacklevel=2)
        llm = load_llm(cfg.llm)
    else:
        raise ValueError(f"{path / WEIGHTS_FILE}: unknown llm_weights {mode!r} (written by a newer west?)")
    model = SpeechLLM(cfg, llm=llm)
    missing, unexpected = model.load_state_dict(load_tensors(path / WEIGHTS_FILE), strict=False)
    skipped = {"included": set(), "path": _frozen_llm_names(model), "referenced": _frozen_llm_names(model),
               "llm_dir": {n for n in model.state_dict() if n.startswith("llm.")}}[mode]
    allowed = _tied_names(model) | skipped  # tied: files written before their aliases were recorded
    missing = [k for k in missing if k not in allowed]
    if missing or unexpected:
        raise ValueError(f"{path / WEIGHTS_FILE}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(device)


def _tied_names(model: nn.Module) -> set:
    """State-dict names whose tensor shares storage with an earlier name (tied embeddings)."""
    seen, tied = set(), set()
    for name, t in model.state_dict().items():
        if t.numel() and t.data_ptr() in seen:
            tied.add(name)
        seen.add(t.data_ptr())
    return tied


def _frozen_llm_names(model: nn.Module) -> set:
    """State-dict names of the LLM that are not trained (parameters and buffers)."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n for n in model.state_dict() if n.startswith("llm.") and n not in trainable}


def export_speech_llm(model: SpeechLLM, out_dir: str | Path, tokenizer=None) -> Path:
    """A self-contained directory: ``DIR/llm`` the LLM as a full Hugging Face model (LoRA
    adapters merged into its weights) with the tokenizer, the rest in ``DIR/model.safetensors``.

    ``model`` is changed in place (its adapters are merged and removed): export is a last step."""
    out = Path(out_dir)
    (out / LLM_DIR).mkdir(parents=True, exist_ok=True)
    llm = model.llm.merge_and_unload() if hasattr(model.llm, "merge_and_unload") else model.llm
    model.llm = llm
    model.cfg = replace(model.cfg, lora=None, llm=replace(model.cfg.llm, path=None, config=None))
    llm.save_pretrained(out / LLM_DIR)
    if tokenizer is not None:
        tokenizer.save_pretrained(out / LLM_DIR)
    (out / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=2))
    state = {n: t for n, t in model.state_dict().items() if not n.startswith("llm.")}
    save_tensors(state, out / WEIGHTS_FILE, {"llm_weights": "llm_dir"})
    return out
