"""Noise audio, jsonl lists and transcripts made on the fly (nothing is downloaded)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile as sf

WORDS = ["hello", "world", "speech", "data", "pack", "batch", "token", "model", "audio", "train",
         "你好", "世界", "今天", "天气"]


def make_wav(path, seconds: float, sr: int = 16000, channels: int = 1, subtype: str = "PCM_16",
             seed: int = 0, fmt: str | None = None) -> Path:
    """Write noise audio; returns the path."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sr))
    data = (0.1 * rng.standard_normal((n, channels))).astype(np.float32)
    sf.write(str(path), data if channels > 1 else data[:, 0], sr, subtype=subtype, format=fmt)
    return Path(path)


def write_jsonl(path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return Path(path)


def transcript(i: int) -> str:
    rng = np.random.default_rng(1000 + i)
    return " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), int(rng.integers(1, 6))))
