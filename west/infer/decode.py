"""Decode a data list with a restored model: generate, write jsonl, score.

Prompts are built by the data pipeline (west.data.generation) with the data section of
the run's config and the model's speech geometry, so the prompt and the features match
training exactly. west.infer.load restores the model.
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

from west.data.config import DataConfig
from west.data.generation import prompt_batches
from west.data.stats import DataStats
from west.data.tokenize import pad_token_id
from west.infer.scoring import ErrorRate, error_rate, read_transcripts
from west.models.speech_llm import SpeechLLM


@dataclass
class DecodeSummary:
    """What west-decode prints: counts, skips, time, where the result went, the score if any."""

    utterances: int
    skipped: dict
    seconds: float
    result: str
    score: Optional[ErrorRate] = None


@torch.no_grad()
def decode_list(model: SpeechLLM, tokenizer, conf: DataConfig, data_list: str, result: str, *,
                beam_size: int = 1, batch_size: int = 8, max_new_tokens: int = 200,
                ref: Optional[str] = None, progress: bool = True, normalizer: str = "none") -> DecodeSummary:
    """Write ``{key, hyp, ref}`` per utterance to ``result`` (atomically, the raw texts) and score
    it after ``normalizer`` (west.infer.scoring.NORMALIZERS)."""
    device = next(model.parameters()).device
    shape = model.cfg.speech_shape()   # how many LLM slots a speech segment takes: the model's fact
    out = Path(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    stats = DataStats(conf.max_warnings)
    eos, pad = tokenizer.eos_token_id, pad_token_id(tokenizer)
    hyps, refs, t0, n = {}, {}, time.perf_counter(), 0
    with open(tmp, "w", encoding="utf-8") as f:
        for batch, batch_refs in prompt_batches(data_list, tokenizer, conf, shape, batch_size, stats):
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
        score = error_rate(read_transcripts(ref), hyps, normalizer=normalizer)
    elif refs and any(refs.values()):
        score = error_rate(refs, hyps, normalizer=normalizer)
    return DecodeSummary(n, stats.as_dict(), time.perf_counter() - t0, str(out), score)
