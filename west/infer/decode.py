"""Decoding a trained model: load a checkpoint, generate for a data list, write jsonl, score.

A checkpoint is either a training checkpoint (``DIR/checkpoints/step_N``, or a
run DIR meaning its latest one), read with the run's ``DIR/config.yaml``, or a
``SpeechLLM.save_pretrained`` export (``west_model.json``). Prompts are built by
the data pipeline (west.data.generation) with the data section of the run's
config, so the prompt and the features match training exactly.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import yaml

from west.data.config import DataConfig
from west.data.generation import prompt_batches
from west.data.stats import DataStats
from west.data.tokenize import pad_token_id
from west.models.config import SpeechLLMConfig
from west.models.speech_llm import CONFIG_FILE, LLM_DIR, SpeechLLM, load_llm
from west.train.checkpoint import find_latest, load_tensors
from west.train.distributed import pick_device
from west.infer.scoring import ErrorRate, error_rate, read_transcripts


@dataclass
class DecodeSummary:
    utterances: int
    skipped: dict
    seconds: float
    result: str
    score: Optional[ErrorRate] = None


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
    try:
        return pick_device(requested)
    except RuntimeError:
        raise ValueError("--device cuda: CUDA is not available") from None


def load_for_decoding(checkpoint: str, config: Optional[str] = None,
                      device: str = "auto") -> tuple[SpeechLLM, object, DataConfig]:
    """(model in eval mode on ``device``, tokenizer, DataConfig of training)."""
    from transformers import AutoConfig, AutoTokenizer

    ckpt = resolve_checkpoint(checkpoint)
    raw = read_run_config(ckpt, config)
    dev = decode_device(device)
    if (ckpt / CONFIG_FILE).is_file():  # save_pretrained export
        model = SpeechLLM.from_pretrained(ckpt)
        tok_dir = ckpt / LLM_DIR if (ckpt / LLM_DIR / "tokenizer_config.json").is_file() else model.cfg.llm.path
        model_cfg = model.cfg
    else:
        if "model" not in raw:
            raise FileNotFoundError(f"{ckpt}: no config.yaml with a model section next to the run "
                                    "(give --config DIR/config.yaml)")
        model_cfg = SpeechLLMConfig.from_dict(raw["model"])
        if not model_cfg.llm.path:
            raise ValueError("model.llm.path is empty in the run config: the tokenizer cannot be loaded")
        # Architecture from the LLM dir, every weight (frozen LLM included) from the checkpoint.
        llm = load_llm(model_cfg.llm, hf_config=AutoConfig.from_pretrained(model_cfg.llm.path))
        model = SpeechLLM(model_cfg, llm=llm)
        model.load_state_dict(load_tensors(ckpt / "model.safetensors"), strict=True)
        tok_dir = model_cfg.llm.path
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    data = dict(raw.get("data") or {})
    data.update(subsampling_rate=model_cfg.encoder.subsampling_rate, projector_stride=model_cfg.projector.stride)
    return model.to(dev).eval(), tokenizer, DataConfig.from_dict(data)


@torch.no_grad()
def decode_list(model: SpeechLLM, tokenizer, conf: DataConfig, data_list: str, result: str, *,
                beam_size: int = 1, batch_size: int = 8, max_new_tokens: int = 200,
                ref: Optional[str] = None, progress: bool = True) -> DecodeSummary:
    """Write ``{key, hyp, ref}`` per utterance to ``result`` (atomically) and score it."""
    device = next(model.parameters()).device
    out = Path(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    stats = DataStats(conf.max_warnings)
    eos, pad = tokenizer.eos_token_id, pad_token_id(tokenizer)
    hyps, refs, t0, n = {}, {}, time.perf_counter(), 0
    with open(tmp, "w", encoding="utf-8") as f:
        for batch, batch_refs in prompt_batches(data_list, tokenizer, conf, batch_size, stats):
            ids = model.generate(batch.to(device), max_new_tokens=max_new_tokens, num_beams=beam_size,
                                 eos_token_id=eos, pad_token_id=pad)
            for key, row, r in zip(batch.keys, ids, batch_refs):
                hyp = tokenizer.decode(row, skip_special_tokens=True).strip()
                f.write(json.dumps({"key": key, "hyp": hyp, "ref": r}, ensure_ascii=False) + "\n")
                hyps[key], refs[key] = hyp, r
            n += len(batch.keys)
            if progress:
                print(f"\rdecoded {n} utterances", end="", file=sys.stderr, flush=True)
    os.replace(tmp, out)
    if progress:
        print(file=sys.stderr)
    score = None
    if ref is not None:
        score = error_rate(read_transcripts(ref), hyps)
    elif refs and any(refs.values()):
        score = error_rate(refs, hyps)
    return DecodeSummary(n, stats.as_dict(), time.perf_counter() - t0, str(out), score)
