"""Qwen3-ASR's log-mel features, per utterance, exactly as its processor computes them.

``Qwen3ASRProcessor`` (transformers 5.25) calls ``Qwen3ASRFeatureExtractor`` with
``padding=True`` (to the longest waveform of the call: none for one utterance): a clip shorter
than ``min_length`` (8000 samples, 0.5 s) is zero-padded to it, and those zeros count as audio;
then Whisper's log-mel (``torch.stft``, n_fft 400, hop 160, periodic Hann, centred with reflect
padding, the last STFT frame dropped, Slaney mel filters, ``log10(max(mel, 1e-10))``, floor at the
utterance's max - 8, ``(x + 4) / 4``). An utterance of n samples gives ``max(n, 8000) // 160``
frames, every one of them real: the processor's attention mask counts the same, and its audio
token count is taken from it. Unlike Whisper's 30 s input, the end of the utterance is reflected,
not followed by zeros, so these are not ``data.features whisper``'s frames.

The processor then pads the mel axis with zeros to a multiple of the encoder's chunk; the encoder
(west.models.qwen3_asr) does that itself, per utterance.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from west.data.stats import SkipSample
from west.data.whisper_features import HOP_LENGTH, N_FFT, SAMPLE_RATE, mel_filters, one_thread

MIN_SAMPLES = 8000   # Qwen3ASRFeatureExtractor's min_length: shorter clips are zero-padded to it


def qwen3_asr_frames(num_samples: int) -> int:
    """Log-mel frames of ``num_samples`` samples at 16 kHz, as Qwen3-ASR's processor counts them."""
    return max(int(num_samples), MIN_SAMPLES) // HOP_LENGTH


def qwen3_asr_log_mel(wave: np.ndarray, n_mels: int = 128, max_frames: Optional[int] = None) -> np.ndarray:
    """(T, n_mels) float32 log-mel of a 16 kHz waveform, T = ``qwen3_asr_frames(len(wave))``.

    Raises the counted ``too_long`` skip for more than ``max_frames`` frames (the model's longest
    input, ``SpeechShape.max_frames``; None: no limit), never truncated."""
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim != 1:
        raise ValueError(f"qwen3_asr_log_mel takes one mono waveform, got shape {wave.shape}")
    n = qwen3_asr_frames(wave.shape[0])
    if max_frames is not None and n > max_frames:
        raise SkipSample("too_long", f"{n} log-mel frames exceed Qwen3-ASR's {max_frames}-frame "
                                     f"({max_frames * HOP_LENGTH / SAMPLE_RATE:.0f} s) input; skipped, not truncated")
    if wave.shape[0] < MIN_SAMPLES:
        wave = np.pad(wave, (0, MIN_SAMPLES - wave.shape[0]))
    with one_thread():
        x = torch.from_numpy(wave)
        stft = torch.stft(x, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), return_complex=True)
        power = stft[..., :-1].abs() ** 2
        log_spec = torch.clamp(mel_filters(n_mels).T @ power, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return ((log_spec + 4.0) / 4.0).T.contiguous().numpy()


__all__ = ["MIN_SAMPLES", "qwen3_asr_frames", "qwen3_asr_log_mel"]
