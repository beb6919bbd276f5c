"""Audio in, features out: decode (soundfile + soxr), log-mel fbank
(kaldi-native-fbank), global CMVN, SpecAugment.

soundfile decodes WAV (8/16/24/32-bit PCM, float), FLAC, OGG; the first
channel of multi-channel audio is kept unless the record names channels (a Lhotse
cut: its channel, or the mean of several); ``soxr`` resamples. Failures become
``SkipSample`` with a category, never an exception that ends the epoch.
Randomness (dither, SpecAugment) comes from a numpy Generator seeded per
sample by (seed, epoch, key), never from a library's hidden global state, so a
resumed epoch computes bit-identical features.
"""
from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import kaldi_native_fbank as knf
import numpy as np
import soundfile as sf
import soxr

from west.data.qwen3_asr_features import qwen3_asr_frames
from west.data.records import AudioSpec
from west.data.stats import SkipSample
from west.data.wav_header import wav_shortfall
from west.data.whisper_features import whisper_frames

if TYPE_CHECKING:   # the config module checks its keys against this one's names
    from west.data.config import DataConfig

# Durations in lists are usually rounded to 10 ms: planning rounds them up by
# half of that so a planned pack is never shorter than what decoding produces.
DURATION_MARGIN_S = 0.005
# A segment may end this far past its audio's last sample (rounding in the list; Lhotse's default
# tolerance); further is a list that asks for audio that is not there (``truncated_audio``).
SEGMENT_END_TOLERANCE_S = 0.025


def resolve_path(path: str, base: Optional[str]) -> str:
    """Relative paths are tried as given (cwd), then relative to the list's folder."""
    if os.path.isabs(path) or os.path.exists(path) or not base:
        return path
    alt = os.path.join(base, path)
    return alt if os.path.exists(alt) else path


def resampled_length(n: int, sr: int, target_sr: int) -> int:
    """Samples soxr returns for ``n`` input samples: round(n * target / sr), halves up."""
    if sr == target_sr:
        return int(n)
    return (2 * int(n) * target_sr + sr) // (2 * sr)


def _segment(spec: AudioSpec, sr: int, n_total: int) -> tuple[int, int]:
    """Sample range of a segment; one that ends past the audio (beyond rounding) is bad input."""
    start = int(round(spec.start * sr)) if spec.start is not None else 0
    stop = int(round(spec.end * sr)) if spec.end is not None else n_total
    if stop - n_total > SEGMENT_END_TOLERANCE_S * sr:
        raise SkipSample("truncated_audio", f"segment ends at {spec.end:.3f}s, past the end of its audio "
                                            f"({n_total / sr:.3f}s)")
    return min(start, n_total), min(stop, n_total)


def read_member(tar: str, offset: int, size: int) -> bytes:
    """The bytes of one tar member, by offset (west.data.shards)."""
    if not os.path.exists(tar):
        raise SkipSample("missing_file", f"shard {tar} does not exist")
    with open(tar, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise SkipSample("corrupt_audio", f"shard {tar} ends inside a member (truncated?)")
    return data


def _open(spec: AudioSpec):
    if spec.data is not None:
        return io.BytesIO(spec.data)
    if spec.tar is not None:
        return io.BytesIO(read_member(spec.tar, spec.offset, spec.size))
    path = resolve_path(spec.path, spec.base)
    if not os.path.exists(path):
        raise SkipSample("missing_file", f"audio file {path} does not exist")
    return path


def audio_num_samples(spec: AudioSpec, target_sr: int) -> int:
    """Samples the loader will produce for ``spec``, from the header only (no decoding)."""
    if spec.cut is not None:   # lhotse loads it (west.data.lhotse_audio): its duration says
        return int(round(float(spec.seconds() or 0.0) * target_sr))
    src = _open(spec)
    try:
        info = sf.info(src)
    except (sf.LibsndfileError, RuntimeError, ValueError) as e:
        raise SkipSample("corrupt_audio", f"cannot read audio header: {e}")
    start, stop = _segment(spec, info.samplerate, info.frames)
    return resampled_length(max(stop - start, 0), info.samplerate, target_sr)


def load_audio(spec: AudioSpec, target_sr: int = 16000) -> np.ndarray:
    """Mono float32 waveform in [-1, 1] at ``target_sr`` (``spec.channels``: their mean, else the first)."""
    if spec.cut is not None:
        from west.data.lhotse_audio import load_cut_audio  # optional extra: lhotse

        data, sr = load_cut_audio(spec.cut)
    else:
        data, sr = _read(spec)
    if data.shape[0] == 0:
        raise SkipSample("empty_audio", "audio has zero samples")
    wave = _mono(data, spec.channels)
    if not np.isfinite(wave).all():
        raise SkipSample("corrupt_audio", "audio holds NaN or infinite samples")
    if sr != target_sr:
        wave = soxr.resample(wave, sr, target_sr, quality="HQ").astype(np.float32, copy=False)
    return wave


def _read(spec: AudioSpec) -> tuple[np.ndarray, int]:
    """(samples, channels) float32 of the spec's segment, and the file's rate."""
    src = _open(spec)
    cut = wav_shortfall(src)
    if cut:
        raise SkipSample("truncated_audio", cut)
    try:
        with sf.SoundFile(src) as f:
            sr, n_total = f.samplerate, f.frames
            start, stop = _segment(spec, sr, n_total)
            f.seek(start)
            return f.read(max(stop - start, 0), dtype="float32", always_2d=True), sr
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as e:
        raise SkipSample("corrupt_audio", f"cannot decode audio: {e}")


def _mono(data: np.ndarray, channels: Optional[tuple[int, ...]]) -> np.ndarray:
    if channels is None or tuple(channels) == (0,):
        return np.ascontiguousarray(data[:, 0])
    if max(channels) >= data.shape[1]:
        raise SkipSample("corrupt_audio", f"channel {max(channels)} asked for, the audio has {data.shape[1]}")
    if len(channels) == 1:
        return np.ascontiguousarray(data[:, channels[0]])
    return data[:, list(channels)].mean(axis=1, dtype=np.float32)


def window_and_shift(conf: DataConfig) -> tuple[int, int]:
    return (int(conf.sample_rate * conf.frame_length_ms / 1000),
            int(conf.sample_rate * conf.frame_shift_ms / 1000))


def fbank_frames(num_samples: int, conf: DataConfig) -> int:
    """Frames kaldi fbank yields for ``num_samples`` (snip_edges=True)."""
    win, shift = window_and_shift(conf)
    return 0 if num_samples < win else 1 + (int(num_samples) - win) // shift


@dataclass(frozen=True)
class FeatureKind:
    """What one value of ``data.features`` implies; an encoder's entry (west.models.encoders) names
    the kind it reads, and the stages computing it are ``west.data.processors.FEATURE_STAGES``."""

    name: str
    frames: Callable[[int, DataConfig], int]  # feature frames of n samples
    list_frames: bool = True                  # a list's num_frames counts these frames (exactly)
    sample_rate: Optional[int] = None         # the rate it needs (None: data.sample_rate)
    cmvn: bool = True                         # data.cmvn applies
    kaldi_feats: bool = True                  # precomputed Kaldi features can stand for it


FEATURE_KINDS: dict[str, FeatureKind] = {k.name: k for k in (
    FeatureKind("fbank", lambda n, conf: fbank_frames(n, conf)),
    # the Whisper model's log-mel: ceil(n / 160) frames, normalised per utterance (no CMVN), from audio only
    FeatureKind("whisper", lambda n, conf: whisper_frames(n), list_frames=False, sample_rate=16000, cmvn=False,
                kaldi_feats=False),
    # Qwen3-ASR's processor's log-mel: max(n, 8000) // 160 frames, the end reflected (west.data.qwen3_asr_features)
    FeatureKind("qwen3_asr", lambda n, conf: qwen3_asr_frames(n), list_frames=False, sample_rate=16000, cmvn=False,
                kaldi_feats=False),
)}


def feature_kind(name: str) -> FeatureKind:
    if name not in FEATURE_KINDS:
        raise ValueError(f"data.features: must be one of {tuple(FEATURE_KINDS)}, got {name!r}")
    return FEATURE_KINDS[name]


def estimate_frames(spec: AudioSpec, conf: DataConfig) -> Optional[int]:
    """Feature frames of an audio spec from metadata; None if unknown.

    A list's ``num_frames`` counts fbank frames: exact for fbank; for another kind (whisper:
    ``ceil(num_samples / 160)``) it bounds the samples, used when there is no ``duration`` (or
    end - start), which gives an upper bound for every kind."""
    kind = feature_kind(conf.features)
    if spec.num_frames is not None and kind.list_frames:
        return int(spec.num_frames)
    dur = spec.seconds()
    if dur is None:
        if spec.num_frames is not None:   # the most samples that give that many fbank frames
            win, shift = window_and_shift(conf)
            return kind.frames(win + int(spec.num_frames) * shift - 1, conf)
        return None
    return kind.frames(math.ceil((dur + DURATION_MARGIN_S) * conf.sample_rate), conf)


def _options(conf: DataConfig) -> knf.FbankOptions:
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = float(conf.sample_rate)
    opts.frame_opts.frame_length_ms = float(conf.frame_length_ms)
    opts.frame_opts.frame_shift_ms = float(conf.frame_shift_ms)
    opts.frame_opts.dither = 0.0          # dither is added here, from a seeded generator
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = conf.num_mel_bins
    opts.energy_floor = 0.0
    return opts


def compute_fbank(wave: np.ndarray, conf: DataConfig, rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """(T, num_mel_bins) float32 log-mel fbank; dither only when ``rng`` is given."""
    x = wave.astype(np.float32) * np.float32(32768.0)     # Kaldi works on the int16 scale
    if rng is not None and conf.dither > 0:
        x += np.float32(conf.dither) * rng.standard_normal(x.shape[0], dtype=np.float32)
    fb = knf.OnlineFbank(_options(conf))
    fb.accept_waveform(float(conf.sample_rate), x.tolist())   # a list converts faster than an ndarray
    fb.input_finished()
    n = fb.num_frames_ready
    if n == 0:
        return np.zeros((0, conf.num_mel_bins), np.float32)
    return np.stack([fb.get_frame(i) for i in range(n)]).astype(np.float32, copy=False)


class GlobalCMVN:
    """Global mean/variance normalisation from a JSON file.

    Reads the WeNet format written by tools/compute_cmvn.py
    (``mean_stat``, ``var_stat``, ``frame_num``) or explicit ``mean``/``istd``.
    """

    def __init__(self, mean: np.ndarray, istd: np.ndarray):
        self.mean = np.asarray(mean, np.float32)
        self.istd = np.asarray(istd, np.float32)

    @classmethod
    def from_json(cls, path: str) -> "GlobalCMVN":
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        if "mean" in d and "istd" in d:
            return cls(np.array(d["mean"]), np.array(d["istd"]))
        try:
            n = float(d["frame_num"])
            mean = np.array(d["mean_stat"], np.float64) / n
            var = np.array(d["var_stat"], np.float64) / n - mean * mean
        except (KeyError, TypeError, ZeroDivisionError) as e:
            raise ValueError(f"{path}: not a CMVN file (need mean_stat/var_stat/frame_num or mean/istd): {e}")
        return cls(mean, 1.0 / np.sqrt(np.maximum(var, 1e-20)))

    def __call__(self, feats: np.ndarray) -> np.ndarray:
        if feats.shape[1] != self.mean.shape[0]:
            raise SkipSample("corrupt_audio", f"features have {feats.shape[1]} bins, CMVN has {self.mean.shape[0]}")
        return (feats - self.mean) * self.istd


def spec_augment(feats: np.ndarray, conf: DataConfig, rng: np.random.Generator) -> np.ndarray:
    """Zero ``spec_aug_num_t_mask`` time and ``spec_aug_num_f_mask`` frequency bands (copy)."""
    y = feats.copy()
    t, f = y.shape
    for _ in range(conf.spec_aug_num_t_mask):
        if t < 2 or conf.spec_aug_max_t < 1:
            break
        start = int(rng.integers(0, t - 1))
        y[start:min(t, start + int(rng.integers(1, conf.spec_aug_max_t + 1))), :] = 0
    for _ in range(conf.spec_aug_num_f_mask):
        if f < 2 or conf.spec_aug_max_f < 1:
            break
        start = int(rng.integers(0, f - 1))
        y[:, start:min(f, start + int(rng.integers(1, conf.spec_aug_max_f + 1)))] = 0
    return y
