"""Whisper's log-mel features, per utterance, exactly as transformers' WhisperFeatureExtractor.

``WhisperFeatureExtractor`` (transformers 5.23, its torch path, which it uses whenever torch
is installed): ``torch.stft`` (n_fft 400, hop 160, periodic Hann, centred with reflect
padding), power spectrum without the last frame, Slaney mel filters from
``transformers.audio_utils.mel_filter_bank`` (0-8 kHz), ``log10(max(mel, 1e-10))``, floor at
the utterance's max - 8, then ``(x + 4) / 4``. No CMVN. The bin count (80 or 128) is the
model's ``num_mel_bins``.

An utterance of n samples gives ceil(n / 160) frames: the frames a processor that pads to 30 s
marks real in its attention mask (Qwen2-Audio's counts its audio tokens from them), each equal to
that processor's frame, since the waveform is followed by zeros here too (400 of them: every frame
that reaches the utterance sees zeros after it, and the floor is the max over those frames, as over
the padded 30 s). The 30 s of padding frames themselves are not computed. Utterances over
Whisper's window (3000 frames) are a counted ``too_long`` skip, never truncated.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator

import numpy as np
import torch

from west.data.stats import SkipSample

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
MAX_FRAMES = 3000  # Whisper's 30 s window: max_source_positions (1500) * conv strides (1 * 2)


def whisper_frames(num_samples: int) -> int:
    """Log-mel frames for ``num_samples`` samples at 16 kHz: the frames whose centre is inside the
    utterance, ceil(n / 160), as a 30 s-padding processor's attention mask counts them."""
    return -(-int(num_samples) // HOP_LENGTH)


@lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> torch.Tensor:
    """(201, n_mels) Slaney filters, built with the same call as WhisperFeatureExtractor."""
    from transformers.audio_utils import mel_filter_bank  # heavy

    bank = mel_filter_bank(num_frequency_bins=1 + N_FFT // 2, num_mel_filters=n_mels, min_frequency=0.0,
                           max_frequency=8000.0, sampling_rate=SAMPLE_RATE, norm="slaney", mel_scale="slaney")
    return torch.from_numpy(bank).to(torch.float32)


def check_whisper_window(n_frames: int, max_frames: int = MAX_FRAMES) -> None:
    """Raise the counted ``too_long`` skip for an utterance longer than Whisper's window."""
    if n_frames > max_frames:
        raise SkipSample("too_long", f"{n_frames} log-mel frames exceed Whisper's {max_frames}-frame "
                                     f"({max_frames * HOP_LENGTH / SAMPLE_RATE:.0f} s) window; skipped, not truncated")


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch ops on one intra-op thread, then restore the count. One utterance's STFT is
    too small to split: with the trainer's threads (loader without workers) the threads'
    hand-offs cost ~20x the work (21 ms vs 1 ms of CPU per 4.5 s utterance on 2 cores)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def whisper_log_mel(wave: np.ndarray, n_mels: int = 80, max_frames: int = MAX_FRAMES) -> np.ndarray:
    """(T, n_mels) float32 log-mel of a 16 kHz waveform in [-1, 1], T = ceil(len(wave) / 160).

    Raises ``SkipSample`` for audio too short for the centred STFT (<= 200 samples) or
    longer than ``max_frames``."""
    wave = np.asarray(wave)
    if wave.ndim != 1:
        raise ValueError(f"whisper_log_mel takes one mono waveform, got shape {wave.shape}")
    if wave.shape[0] <= N_FFT // 2:
        raise SkipSample("too_short", f"{wave.shape[0]} samples: Whisper features need > {N_FFT // 2}")
    check_whisper_window(whisper_frames(wave.shape[0]), max_frames)
    with one_thread():
        x = torch.from_numpy(wave).to(torch.float32)
        x = torch.cat([x, x.new_zeros(N_FFT)])   # zeros after it, as in the padded 30 s
        stft = torch.stft(x, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()
        log_spec = torch.clamp(mel_filters(n_mels).T @ power, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)[:, : whisper_frames(wave.shape[0])]
        return ((log_spec + 4.0) / 4.0).T.contiguous().numpy()


__all__ = ["MAX_FRAMES", "check_whisper_window", "mel_filters", "whisper_frames", "whisper_log_mel"]
