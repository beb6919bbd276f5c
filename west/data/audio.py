"""Read audio as mono float32 at the model's sample rate.

soundfile decodes WAV (8/16/24/32-bit PCM, float), FLAC, OGG; the first
channel of multi-channel audio is kept; ``soxr`` resamples. Failures become
``SkipSample`` with a category, never an exception that ends the epoch.
"""
from __future__ import annotations

import io
import os
from typing import Optional

import numpy as np
import soundfile as sf
import soxr

from west.data.stats import SkipSample


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


def _segment(spec: dict, sr: int, n_total: int) -> tuple[int, int]:
    start = int(round(spec["start"] * sr)) if spec.get("start") is not None else 0
    stop = int(round(spec["end"] * sr)) if spec.get("end") is not None else n_total
    return min(start, n_total), min(stop, n_total)


def _read_member(tar: str, offset: int, size: int) -> bytes:
    """The bytes of one tar member, by offset (west.data.shards)."""
    if not os.path.exists(tar):
        raise SkipSample("missing_file", f"shard {tar} does not exist")
    with open(tar, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise SkipSample("corrupt_audio", f"shard {tar} ends inside a member (truncated?)")
    return data


def _open(spec: dict):
    if spec.get("bytes") is not None:
        return io.BytesIO(spec["bytes"])
    if spec.get("tar") is not None:
        return io.BytesIO(_read_member(spec["tar"], spec["offset"], spec["size"]))
    path = resolve_path(spec["path"], spec.get("base"))
    if not os.path.exists(path):
        raise SkipSample("missing_file", f"audio file {path} does not exist")
    return path


def audio_num_samples(spec: dict, target_sr: int) -> int:
    """Samples the loader will produce for ``spec``, from the header only (no decoding)."""
    src = _open(spec)
    try:
        info = sf.info(src)
    except (sf.LibsndfileError, RuntimeError, ValueError) as e:
        raise SkipSample("corrupt_audio", f"cannot read audio header: {e}")
    start, stop = _segment(spec, info.samplerate, info.frames)
    return resampled_length(max(stop - start, 0), info.samplerate, target_sr)


def load_audio(spec: dict, target_sr: int = 16000) -> np.ndarray:
    """Mono float32 waveform in [-1, 1] at ``target_sr``."""
    src = _open(spec)
    try:
        with sf.SoundFile(src) as f:
            sr, n_total = f.samplerate, f.frames
            start, stop = _segment(spec, sr, n_total)
            f.seek(start)
            data = f.read(max(stop - start, 0), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as e:
        raise SkipSample("corrupt_audio", f"cannot decode audio: {e}")
    if data.shape[0] == 0:
        raise SkipSample("empty_audio", "audio has zero samples")
    wave = np.ascontiguousarray(data[:, 0])
    if not np.isfinite(wave).all():
        raise SkipSample("corrupt_audio", "audio holds NaN or infinite samples")
    if sr != target_sr:
        wave = soxr.resample(wave, sr, target_sr, quality="HQ").astype(np.float32, copy=False)
    return wave
