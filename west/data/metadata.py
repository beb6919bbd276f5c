"""LLM-token lengths of every record from list metadata (no audio is read).

A planned epoch needs every sample's length up front. ``LengthTable`` gets each
record while the list is parsed (one pass), estimates fbank frames from
``num_frames`` (exact) or ``duration`` (upper bound), tokenizes transcripts in
batches, and applies the filters that need no audio: min/max duration and the
LLM-token budget. Skips found here are counted and warned about once, at
start-up.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from west.data.config import DataConfig
from west.data.features import estimate_frames
from west.data.stats import DataStats
from west.data.tokenize import PromptEncoder

_CHUNK = 8192


def token_budget(conf: DataConfig) -> Optional[int]:
    """Most LLM tokens one sample may have in this batch mode (None: no limit)."""
    return {"pack": conf.pack_tokens, "dynamic": conf.max_tokens_in_batch}.get(conf.batch_type)


class LengthTable:
    """Collects lengths record by record; ``finish()`` returns them, or None if some are unknown."""

    def __init__(self, encoder: PromptEncoder, conf: DataConfig, stats: DataStats, required: bool):
        self.encoder, self.conf, self.stats, self.required = encoder, conf, stats, required
        self.known = True
        self.missing: Optional[str] = None
        self._lengths: list[int] = []
        self._keep: list[bool] = []
        self._chunk: list[tuple[dict, list[int]]] = []

    def add(self, rec: dict) -> None:
        if not self.known:
            return
        frames = [estimate_frames(a, self.conf) for a in rec["audio"]]
        if any(f is None for f in frames):
            if self.required:
                raise ValueError(f"{rec['src']}: plan='always' but {rec['key']} has no duration/num_frames")
            self.known, self.missing = False, f"{rec['src']} (key {rec['key']})"
            self._chunk.clear()
            return
        self._chunk.append((rec, frames))
        if len(self._chunk) >= _CHUNK:
            self._flush()

    def _flush(self) -> None:
        conf, budget = self.conf, token_budget(self.conf)
        shift_s = conf.frame_shift_ms / 1000
        recs = [r for r, _ in self._chunk]
        frames = [f for _, f in self._chunk]
        for rec, fr, length in zip(recs, frames, self.encoder.lengths(recs, frames)):
            secs = sum(a.get("duration") or f * shift_s for a, f in zip(rec["audio"], fr))
            why = None
            if length == 0:
                why = ("too_short", "audio gives no encoder frame")
            elif conf.min_duration and rec["audio"] and secs < conf.min_duration:
                why = ("too_short", f"{secs:.3f}s < min_duration {conf.min_duration}s")
            elif conf.max_duration and secs > conf.max_duration:
                why = ("too_long", f"{secs:.3f}s > max_duration {conf.max_duration}s")
            elif budget is not None and length > budget:
                why = ("too_long", f"{length} LLM tokens > budget {budget}")
            if why is not None:
                self.stats.skip(why[0], f"{rec['src']} (key {rec['key']})", why[1])
            self._lengths.append(length)
            self._keep.append(why is None)
        self._chunk.clear()

    def finish(self) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(lengths of all records, indices of the records that passed the filters)."""
        if not self.known:
            return None
        self._flush()
        return np.asarray(self._lengths, np.int64), np.nonzero(np.asarray(self._keep, bool))[0]
