"""Whisper log-mel features equal transformers' WhisperFeatureExtractor, per utterance."""
import numpy as np
import pytest
from transformers import WhisperFeatureExtractor

from west.data.stats import SkipSample
from west.data.whisper_features import MAX_FRAMES, whisper_frames, whisper_log_mel


def wave(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("n", [16000 * 3 + 37, 32370, 14407, 4000, 800, 201])
def test_equals_the_30s_padding_processors_real_frames(n_mels, n):
    """Any length, multiples of 160 or not: the frames a processor that pads to 30 s marks real
    (ceil(n / 160), its attention mask), each equal to that processor's."""
    w = wave(n)
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    out = fe(w, sampling_rate=16000, return_tensors="np", return_attention_mask=True)
    real = int(out["attention_mask"][0].sum())
    want = out["input_features"][0].T[:real]
    got = whisper_log_mel(w, n_mels)
    assert got.shape == want.shape == (whisper_frames(n), n_mels) and real == -(-n // 160)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_the_30s_padding_after_the_real_frames():
    """What the encoder's pad_to_30s mode fills in: the processor's padding frames are the silence
    floor from the third frame after the real ones on; the two before it still see the utterance's
    last samples in their window, and the fill differs there (docs/models.md)."""
    w = wave(16000 * 2 + 123)
    fe = WhisperFeatureExtractor(feature_size=80)
    padded = fe(w, sampling_rate=16000, return_tensors="np")["input_features"][0].T   # (3000, 80)
    t = whisper_log_mel(w, 80).shape[0]
    fill = max(float(padded.max()) - 2.0, -1.5)
    np.testing.assert_allclose(padded[t + 2:], fill, atol=1e-6)
    assert np.abs(padded[t:t + 2] - fill).max() > 1e-3


def test_too_long_and_too_short_are_counted_skips():
    with pytest.raises(SkipSample) as e:
        whisper_log_mel(np.zeros(MAX_FRAMES * 160 + 1, np.float32))   # one sample past 30 s
    assert e.value.category == "too_long" and "3000-frame (30 s)" in e.value.message
    assert whisper_log_mel(np.zeros(MAX_FRAMES * 160, np.float32)).shape == (MAX_FRAMES, 80)
    with pytest.raises(SkipSample) as e:
        whisper_log_mel(np.zeros(200, np.float32))
    assert e.value.category == "too_short"


def test_log_mel_runs_on_one_thread_and_restores_the_count():
    """Per-utterance STFTs run single-threaded (threads cost more than they give at this size);
    the caller's thread count comes back afterwards, also when the utterance is skipped."""
    import torch

    seen = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        real_stft = torch.stft

        def spy(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return real_stft(*args, **kwargs)

        torch.stft = spy
        try:
            whisper_log_mel(np.zeros(16000, np.float32))
        finally:
            torch.stft = real_stft
        assert seen == [1] and torch.get_num_threads() == 2
        with pytest.raises(SkipSample):
            whisper_log_mel(np.zeros(100, np.float32))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
