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
@pytest.mark.parametrize("n", [16000 * 3 + 37, 4000, 800])
def test_equals_feature_extractor_unpadded(n_mels, n):
    w = wave(n)
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    want = fe(w, sampling_rate=16000, padding="longest", return_tensors="np")["input_features"][0].T
    got = whisper_log_mel(w, n_mels)
    assert got.shape == want.shape == (whisper_frames(n), n_mels)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # the numpy path of the same extractor agrees to its documented tolerance
    np_path = fe._np_extract_fbank_features(w[None].astype(np.float64), "cpu")[0].T
    np.testing.assert_allclose(got, np_path, rtol=0, atol=1e-4)


def test_matches_the_30s_padded_features_away_from_the_end():
    """What pad-to-30 s users get: the same frames, except the last two (STFT window over the pad)."""
    w = wave(16000 * 2 + 123)
    fe = WhisperFeatureExtractor(feature_size=80)
    padded = fe(w, sampling_rate=16000, return_tensors="np")["input_features"][0].T   # (3000, 80)
    got = whisper_log_mel(w, 80)
    t = got.shape[0]
    np.testing.assert_allclose(got[: t - 2], padded[: t - 2], atol=1e-5)
    # the padding frames are the silence floor the encoder's pad_to_30s mode fills in
    np.testing.assert_allclose(padded[t + 2:], max(float(padded.max()) - 2.0, -1.5), atol=1e-6)


def test_too_long_and_too_short_are_counted_skips():
    with pytest.raises(SkipSample) as e:
        whisper_log_mel(np.zeros((MAX_FRAMES + 1) * 160, np.float32))
    assert e.value.category == "too_long" and "3000-frame (30 s)" in e.value.message
    assert whisper_log_mel(np.zeros(MAX_FRAMES * 160 + 159, np.float32)).shape == (MAX_FRAMES, 80)
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
