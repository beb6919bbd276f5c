"""Synthetic length distributions for benchmarks and tests.

AIShell-1-like: utterance durations are lognormal with mean ≈ 4.5 s, clipped to
[1.2, 15] s. In the speech LLM an utterance costs 12.5 LLM positions per second
of speech (fbank 100 fps, 4x subsampling, 2x projector), ~15 prompt tokens and
~3.5 transcript tokens per second.
"""
from __future__ import annotations

import numpy as np

SPEECH_TOKENS_PER_SECOND = 12.5
TEXT_TOKENS_PER_SECOND = 3.5
PROMPT_TOKENS = 15


def aishell_like_durations(n: int, seed: int = 0, mean: float = 4.5, sigma: float = 0.35) -> np.ndarray:
    """Durations in seconds, lognormal with the given mean, clipped to [1.2, 15]."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean) - sigma * sigma / 2.0
    return np.clip(rng.lognormal(mu, sigma, n), 1.2, 15.0)


def aishell_like_tokens(n: int, seed: int = 0) -> np.ndarray:
    """LLM tokens per utterance (prompt + speech slots + transcript)."""
    d = aishell_like_durations(n, seed)
    tokens = PROMPT_TOKENS + np.round(d * SPEECH_TOKENS_PER_SECOND) + np.round(d * TEXT_TOKENS_PER_SECOND)
    return tokens.astype(np.int64)


def uniform_tokens(n: int, low: int = 1000, high: int = 20000, seed: int = 0) -> np.ndarray:
    """Uniform integers in [low, high): a long-document workload."""
    return np.random.default_rng(seed).integers(low, high, n, dtype=np.int64)
