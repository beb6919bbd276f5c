"""Per-sample pipeline stages, each a plain generator: Records in, Samples out (west.data.records).

    records -> load_audio -> fbank -> cmvn -> spec_augment -> tokenize      (data.features fbank)
    records -> load_audio -> whisper_features -> spec_augment -> tokenize   (data.features whisper)
    records -> load_audio -> qwen3_asr_features -> spec_augment -> tokenize (data.features qwen3_asr)

The feature stages are chosen once, from ``data.features`` (``FEATURE_STAGES``).

Length filters ran when the epoch was planned (``west.data.lengths``); here
only the hard limit is checked again: a sample whose decoded length exceeds the
policy's budget (the list's duration was wrong) is skipped, never truncated.

A stage that rejects a sample raises ``SkipSample`` inside ``_each``; the
sample is counted in ``stats`` (with its list file and line) and the stream
goes on. Randomness is drawn per sample from (seed, epoch, key), so a sample's
features do not depend on which worker decodes it or on what came before.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Union

import numpy as np

from west.data.config import DataConfig
from west.data.features import GlobalCMVN, compute_fbank, read_member
from west.data.features import load_audio as _load_audio
from west.data.features import spec_augment as _spec_augment
from west.data.lengths import check_budget
from west.data.lhotse_audio import load_cut_features
from west.data.qwen3_asr_features import qwen3_asr_log_mel
from west.data.records import AudioSpec, Record, Sample
from west.data.stats import DataStats, SkipSample
from west.data.tokenize import PromptEncoder
from west.data.whisper_features import MAX_FRAMES, whisper_log_mel


@dataclass
class DecodeContext:
    conf: DataConfig
    encoder: PromptEncoder
    stats: DataStats
    cmvn: Optional[GlobalCMVN] = None
    training: bool = True
    seed: int = 0
    epoch: int = 0
    budget: Optional[int] = None         # LLM-token budget of one sample (the batching policy's)


def sample_rng(seed: int, epoch: int, key: str, stream: int) -> np.random.Generator:
    """Generator owned by one sample: same numbers on any worker, rank or resume."""
    return np.random.default_rng([seed, epoch, zlib.crc32(key.encode("utf-8")), stream])


def _each(items: Iterable[Union[Record, Sample]], stats: DataStats,
          fn: Callable[[Union[Record, Sample]], Sample]) -> Iterator[Sample]:
    for s in items:
        try:
            yield fn(s)
        except SkipSample as e:
            stats.skip(e.category, f"{s.src} (key {s.key})", e.message)


def _load(record: Record, sr: int, num_mel_bins: int) -> Sample:
    waves, feats = [], []
    for spec in record.audio:
        if spec.ark is not None:
            feats.append(_load_ark(spec.ark, num_mel_bins))
            continue
        if spec.features is not None:
            feats.append(_load_cut_features(spec, num_mel_bins))
            continue
        try:
            waves.append(_load_audio(spec, sr))
        except SkipSample:
            raise
        except Exception as e:   # any decoder failure is bad input, not a reason to stop the epoch
            raise SkipSample("corrupt_audio", f"cannot decode audio: {type(e).__name__}: {e}")
    return Sample(record, waves=waves, feats=feats)


def _load_ark(ark: str, num_mel_bins: int) -> np.ndarray:
    import kaldiio  # heavy

    try:
        mat = np.asarray(kaldiio.load_mat(ark), dtype=np.float32)
    except FileNotFoundError as e:
        raise SkipSample("missing_file", f"feature file missing: {e}")
    except Exception as e:
        raise SkipSample("corrupt_audio", f"cannot read features {ark}: {type(e).__name__}: {e}")
    if mat.ndim != 2 or mat.shape[1] != num_mel_bins:
        raise SkipSample("corrupt_audio", f"features {ark} have shape {mat.shape}, expected (T, {num_mel_bins})")
    if mat.shape[0] == 0:
        raise SkipSample("empty_audio", "feature matrix has zero frames")
    return mat


def _load_cut_features(spec: AudioSpec, num_mel_bins: int) -> np.ndarray:
    member = read_member(spec.tar, spec.offset, spec.size) if spec.tar is not None else b""
    mat = load_cut_features(spec.cut, spec.features, member)
    if mat.ndim != 2 or mat.shape[1] != num_mel_bins:
        raise SkipSample("corrupt_audio", f"Lhotse features of shape {mat.shape}, expected (T, {num_mel_bins})")
    if mat.shape[0] == 0:
        raise SkipSample("empty_audio", "feature matrix has zero frames")
    return mat


def load_audio(records: Iterable[Record], ctx: DecodeContext) -> Iterator[Sample]:
    """Decode every audio part (soundfile + soxr), or read Kaldi or Lhotse features."""
    return _each(records, ctx.stats, lambda s: _load(s, ctx.conf.sample_rate, ctx.conf.num_mel_bins))


def fbank(samples: Iterable[Sample], ctx: DecodeContext) -> Iterator[Sample]:
    """Waveforms -> (T, num_mel_bins) fbank; dither only in training."""
    def run(s: Sample) -> Sample:
        if s.waves:
            rng = sample_rng(ctx.seed, ctx.epoch, s.key, 0) if ctx.training else None
            s.feats = [compute_fbank(w, ctx.conf, rng) for w in s.waves]
        s.waves = []
        for f in s.feats:
            if f.shape[0] == 0:
                raise SkipSample("too_short", "audio shorter than one fbank window")
        return s

    return _each(samples, ctx.stats, run)


def cmvn(samples: Iterable[Sample], ctx: DecodeContext) -> Iterator[Sample]:
    if ctx.cmvn is None:
        return iter(samples)

    def run(s: Sample) -> Sample:
        s.feats = [ctx.cmvn(f) for f in s.feats]
        return s

    return _each(samples, ctx.stats, run)


def whisper_features(samples: Iterable[Sample], ctx: DecodeContext) -> Iterator[Sample]:
    """Waveforms -> (T, n_mels) Whisper log-mel (no 30 s padding, no CMVN, no dither); longer
    than the model's window: a counted ``too_long`` skip, never truncated."""
    return _model_log_mel(samples, ctx, whisper_log_mel, MAX_FRAMES)


def qwen3_asr_features(samples: Iterable[Sample], ctx: DecodeContext) -> Iterator[Sample]:
    """Waveforms -> (T, n_mels) Qwen3-ASR log-mel, as its processor computes it (no CMVN, no
    dither); longer than the model takes: a counted ``too_long`` skip, never truncated."""
    return _model_log_mel(samples, ctx, qwen3_asr_log_mel, None)


def _model_log_mel(samples: Iterable[Sample], ctx: DecodeContext, log_mel: Callable,
                   default_max: Optional[int]) -> Iterator[Sample]:
    """A released model's own log-mel of every waveform, ``log_mel(wave, n_mels, max_frames)``; the
    longest input is the encoder's (``SpeechShape.max_frames``), else ``default_max``."""
    max_frames = ctx.encoder.shape.max_frames or default_max

    def run(s: Sample) -> Sample:
        if s.feats:
            raise ValueError(f"{s.src} (key {s.key}): data.features {ctx.conf.features} computes features from "
                             "audio; precomputed Kaldi features (feats.scp) cannot be used")
        s.feats = [log_mel(w, ctx.conf.num_mel_bins, max_frames) for w in s.waves]
        s.waves = []
        return s

    return _each(samples, ctx.stats, run)


def spec_augment(samples: Iterable[Sample], ctx: DecodeContext) -> Iterator[Sample]:
    """Time/frequency masking, training only."""
    if not (ctx.training and ctx.conf.spec_aug):
        return iter(samples)

    def run(s: Sample) -> Sample:
        rng = sample_rng(ctx.seed, ctx.epoch, s.key, 1)
        s.feats = [_spec_augment(f, ctx.conf, rng) for f in s.feats]
        return s

    return _each(samples, ctx.stats, run)


def tokenize(samples: Iterable[Sample], ctx: DecodeContext) -> Iterator[Sample]:
    """Ids/labels/spans; an utterance over the LLM-token budget is skipped, never truncated."""
    def run(s: Sample) -> Sample:
        enc = ctx.encoder.encode(s.record, [f.shape[0] for f in s.feats])
        s.enc, s.length = enc, len(enc.ids) - enc.shared   # a shared prompt prefix is laid out once per row
        check_budget(s.length, ctx.budget)
        return s

    return _each(samples, ctx.stats, run)


FEATURE_STAGES = {"fbank": (fbank, cmvn), "whisper": (whisper_features,), "qwen3_asr": (qwen3_asr_features,)}
STAGES = (load_audio, *FEATURE_STAGES["fbank"], spec_augment, tokenize)


def stages(conf: DataConfig) -> tuple:
    """The whole chain for ``conf.features``."""
    return (load_audio, *FEATURE_STAGES[conf.features], spec_augment, tokenize)


def decode(records: Iterable[Record], ctx: DecodeContext) -> Iterator[Sample]:
    """Records -> samples ready to batch (every stage of ``stages(conf)`` in order)."""
    stream: Iterable = records
    for stage in stages(ctx.conf):
        stream = stage(stream, ctx)
    return iter(stream)
