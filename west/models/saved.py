"""A trained SpeechLLM as a directory: west config, the LLM's HF config (+ tokenizer), weights.

``DIR/west_model.json`` (the model section), ``DIR/llm/`` (config.json, generation config,
tokenizer), ``DIR/model.safetensors``: all weights (``llm_weights: included``), all but the
frozen LLM's (``path``: reloaded from model.llm.path), or, written by :func:`export_speech_llm`,
all but the LLM's, which is a complete Hugging Face model in ``DIR/llm`` (``llm_dir``: LoRA
merged, loadable by ``AutoModelForCausalLM.from_pretrained(DIR/llm)`` on its own)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from west.models.config import SpeechLLMConfig
from west.models.llm import load_llm
from west.models.speech_llm import SpeechLLM

CONFIG_FILE = "west_model.json"
WEIGHTS_FILE = "model.safetensors"
LLM_DIR = "llm"


def save_speech_llm(model: SpeechLLM, out_dir: str | Path, tokenizer=None, include_frozen_llm: bool = True) -> Path:
    """Write west config, the LLM's HF config (+ tokenizer) and all weights (safetensors).

    ``include_frozen_llm=False`` leaves out the LLM's frozen weights (they are
    reloaded from ``model.llm.path``), keeping checkpoints of a frozen 1.5B LLM small."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    (out / LLM_DIR).mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=2))
    base = model._base_llm()
    base.config.save_pretrained(out / LLM_DIR)
    base.generation_config.save_pretrained(out / LLM_DIR)
    if tokenizer is not None:
        tokenizer.save_pretrained(out / LLM_DIR)
    if not include_frozen_llm and not model.cfg.llm.path:
        raise ValueError("include_frozen_llm=False needs model.llm.path to reload the LLM from")
    skip = set() if include_frozen_llm else _frozen_llm_names(model)
    state, seen = {}, set()
    for name, t in model.state_dict().items():
        if name in skip or (t.numel() and t.data_ptr() in seen):  # tied weights: stored once
            continue
        seen.add(t.data_ptr())
        state[name] = t.detach().contiguous().cpu()
    save_file(state, str(out / WEIGHTS_FILE), metadata={"llm_weights": "included" if include_frozen_llm else "path"})
    return out


def load_speech_llm(path: str | Path, device: str | torch.device = "cpu") -> SpeechLLM:
    """Inverse of :func:`save_speech_llm`; the LLM architecture comes from ``path/llm``."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = Path(path)
    cfg = SpeechLLMConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        mode = (f.metadata() or {}).get("llm_weights", "included")
    if mode == "included":
        llm = load_llm(cfg.llm, hf_config=AutoConfig.from_pretrained(path / LLM_DIR))
    elif mode == "llm_dir":  # a west-export: the LLM is the full HF model in DIR/llm
        cfg.llm.path = str(path / LLM_DIR)
        llm = load_llm(cfg.llm)
    else:
        llm = load_llm(cfg.llm)  # frozen weights from model.llm.path
    model = SpeechLLM(cfg, llm=llm)
    missing, unexpected = model.load_state_dict(load_file(str(path / WEIGHTS_FILE)), strict=False)
    skipped = {"included": set(), "path": _frozen_llm_names(model),
               "llm_dir": {n for n in model.state_dict() if n.startswith("llm.")}}[mode]
    allowed = _tied_names(model) | skipped
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
    from dataclasses import replace

    from safetensors.torch import save_file

    out = Path(out_dir)
    (out / LLM_DIR).mkdir(parents=True, exist_ok=True)
    llm = model.llm.merge_and_unload() if hasattr(model.llm, "merge_and_unload") else model.llm
    model.llm = llm
    model.cfg = replace(model.cfg, lora=None, llm=replace(model.cfg.llm, path=None, config=None))
    llm.save_pretrained(out / LLM_DIR)
    if tokenizer is not None:
        tokenizer.save_pretrained(out / LLM_DIR)
    (out / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=2))
    state = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items() if not n.startswith("llm.")}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"llm_weights": "llm_dir"})
    return out
