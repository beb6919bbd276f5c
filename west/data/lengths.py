"""LLM-token lengths of every record from list metadata (no audio is read).

Every epoch is planned, so every sample's length is needed up front.
``LengthTable`` gets each record while its list is parsed (one pass), takes
feature frames from ``num_frames`` (exact fbank) or ``duration`` (an upper bound),
tokenizes transcripts in batches, and applies the length filters, here and
only here: empty audio, min/max duration, the encoder's window (Whisper: 30 s)
and the batching policy's per-sample token budget. A record without a length is an error that names the line and
``tools/compute_lengths.py``. Skips found here are counted once, at start-up.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from west.data.config import DataConfig
from west.data.features import audio_num_samples, estimate_frames, fbank_frames, feature_kind
from west.data.records import AudioSpec, Record
from west.data.stats import DataStats, SkipSample
from west.data.tokenize import PromptEncoder

_CHUNK = 8192


def measure_audio(spec: AudioSpec, conf: DataConfig) -> tuple[int, float]:
    """(fbank frames, seconds) the loader will compute for an audio spec, from its header only
    (what tools/compute_lengths.py and tools/make_shard_list.py write into lists and indexes)."""
    n = audio_num_samples(spec, conf.sample_rate)
    return fbank_frames(n, conf), round(n / conf.sample_rate, 4)


def check_budget(n_tokens: int, budget: Optional[int]) -> None:
    """A sample longer than the budget is skipped, never truncated."""
    if budget is not None and n_tokens > budget:
        raise SkipSample("too_long", f"{n_tokens} LLM tokens > budget {budget}")


def check_window(frames: list[int], max_frames: Optional[int]) -> None:
    """An audio part longer than the encoder's window (Whisper: 3000 frames, 30 s) is skipped, never truncated."""
    longest = max(frames, default=0)
    if max_frames is not None and longest > max_frames:
        raise SkipSample("too_long", f"{longest} feature frames > the encoder's window of {max_frames} "
                                     "(Whisper: 30 s); skipped, not truncated")


def check_record(secs: float, n_tokens: int, conf: DataConfig, budget: Optional[int], has_audio: bool) -> None:
    """The length filters of one record (raises SkipSample)."""
    if has_audio and secs <= 0:
        raise SkipSample("empty_audio", "audio has zero length")
    if n_tokens == 0:
        raise SkipSample("too_short", "audio gives no encoder frame")
    if conf.min_duration and has_audio and secs < conf.min_duration:
        raise SkipSample("too_short", f"{secs:.3f}s < min_duration {conf.min_duration}s")
    if conf.max_duration and secs > conf.max_duration:
        raise SkipSample("too_long", f"{secs:.3f}s > max_duration {conf.max_duration}s")
    check_budget(n_tokens, budget)


class ListLengths(NamedTuple):
    """A list's records as :meth:`LengthTable.finish` gives them, one entry per record. Encoder
    frames are exact from ``num_frames``, an upper bound from ``duration``."""

    lengths: np.ndarray          # LLM tokens
    usable: np.ndarray           # indices of the records that passed the filters
    encoder_frames: np.ndarray   # after the encoder's subsampling, all audio parts together
    audio_parts: np.ndarray      # speech segments (one per audio part)
    longest_part: np.ndarray     # the longest audio part, in encoder frames


class LengthTable:
    """Collects lengths record by record; ``finish()`` returns them as :class:`ListLengths`."""

    def __init__(self, encoder: PromptEncoder, conf: DataConfig, stats: DataStats, budget: Optional[int],
                 list_path: str):
        self.encoder, self.conf, self.stats, self.budget = encoder, conf, stats, budget
        self.list_path = list_path
        self.kaldi_feats = feature_kind(conf.features).kaldi_feats
        self._lengths: list[int] = []
        self._keep: list[bool] = []
        self._encoder_frames: list[int] = []   # after the encoder's subsampling, all audio parts
        self._parts: list[int] = []
        self._longest: list[int] = []
        self._chunk: list[tuple[Record, list[int]]] = []

    def add(self, rec: Record) -> None:
        if not self.kaldi_feats and any(a.ark is not None or a.features is not None for a in rec.audio):
            raise ValueError(f"{rec.src}: {rec.key} has precomputed features; data.features "
                             f"{self.conf.features} computes its features from audio (give a list of audio files)")
        for a in rec.audio:
            shift = a.cut["features"].get("frame_shift") if a.features is not None else None
            if shift is not None and abs(1000 * float(shift) - self.conf.frame_shift_ms) > 1e-6:
                raise ValueError(f"{rec.src}: {rec.key} has Lhotse features with a frame shift of {1000 * shift:g} ms; "
                                 f"data.frame_shift_ms is {self.conf.frame_shift_ms:g}")
        frames = [estimate_frames(a, self.conf) for a in rec.audio]
        if any(f is None for f in frames):
            raise ValueError(f"{rec.src}: {rec.key} has no duration/num_frames, and every epoch is planned "
                             f"from lengths: run `python tools/compute_lengths.py {self.list_path} OUT` once "
                             "and train on OUT")
        self._chunk.append((rec, frames))
        if len(self._chunk) >= _CHUNK:
            self._flush()

    def _flush(self) -> None:
        shift_s = self.conf.frame_shift_ms / 1000
        recs = [r for r, _ in self._chunk]
        frames = [f for _, f in self._chunk]
        for rec, fr, length in zip(recs, frames, self.encoder.lengths(recs, frames)):
            secs = sum(_seconds(a, f, shift_s) for a, f in zip(rec.audio, fr))
            try:
                check_record(secs, length, self.conf, self.budget, bool(rec.audio))
                check_window(fr, self.encoder.shape.max_frames)
                keep = True
            except SkipSample as e:
                self.stats.skip(e.category, f"{rec.src} (key {rec.key})", e.message)
                keep = False
            self._lengths.append(length)
            self._keep.append(keep)
            per_part = [self.encoder.shape.encoder_frames(f) for f in fr]
            self._encoder_frames.append(sum(per_part))
            self._parts.append(len(per_part))
            self._longest.append(max(per_part, default=0))
        self._chunk.clear()

    def finish(self) -> ListLengths:
        """Every record's lengths, and which passed the filters."""
        self._flush()
        return ListLengths(np.asarray(self._lengths, np.int64), np.nonzero(np.asarray(self._keep, bool))[0],
                           *(np.asarray(a, np.int64) for a in (self._encoder_frames, self._parts, self._longest)))


def _seconds(spec: AudioSpec, frames: int, shift_s: float) -> float:
    said = spec.seconds()
    return said if said is not None else frames * shift_s
