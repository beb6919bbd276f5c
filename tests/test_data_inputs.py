"""Lists and audio: every input format parses, odd audio is converted, bad lines are named."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import soundfile as sf
import soxr

from west.data.config import DataConfig
from west.data.features import audio_num_samples, estimate_frames, fbank_frames, load_audio, resampled_length
from west.data.lists import RawList, detect_data_type, parse_json_record
from west.data.records import AudioSpec
from west.data.stats import DataStats, SkipSample

from helpers.corpus import make_wav, write_jsonl


@pytest.mark.parametrize("sr,n", [(8000, 4001), (22050, 12345), (44100, 44101), (48000, 100001),
                                  (32000, 33333), (32000, 5), (11025, 7), (16000, 999)])
def test_resampled_length_matches_soxr(sr, n):
    assert resampled_length(n, sr, 16000) == len(soxr.resample(np.zeros(n, np.float32), sr, 16000))


@pytest.mark.parametrize("subtype,sr,channels,fmt", [
    ("PCM_U8", 16000, 1, "WAV"),       # 8-bit unsigned PCM
    ("PCM_24", 16000, 1, "WAV"),       # 24-bit PCM
    ("PCM_16", 16000, 1, "FLAC"),      # FLAC
    ("PCM_16", 44100, 2, "WAV"),       # 44.1 kHz stereo
    ("PCM_32", 8000, 1, "WAV"),
    ("FLOAT", 24000, 3, "WAV"),
])
def test_odd_audio_is_converted_not_skipped(tmp_path, subtype, sr, channels, fmt):
    path = make_wav(tmp_path / f"a.{fmt.lower()}", 0.5, sr=sr, channels=channels, subtype=subtype, fmt=fmt)
    spec = AudioSpec(path=str(path))
    wave = load_audio(spec, 16000)
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert len(wave) == resampled_length(int(0.5 * sr), sr, 16000) == audio_num_samples(spec, 16000)
    assert 0.01 < np.abs(wave).max() <= 1.0


def test_first_channel_is_kept(tmp_path):
    data = np.stack([np.full(1600, 0.25, np.float32), np.full(1600, -0.5, np.float32)], 1)
    sf.write(tmp_path / "st.wav", data, 16000, subtype="FLOAT")
    assert np.allclose(load_audio(AudioSpec(path=str(tmp_path / "st.wav"))), 0.25)


def test_segment_and_relative_path(tmp_path):
    make_wav(tmp_path / "long.wav", 2.0)
    spec = AudioSpec(path="long.wav", base=str(tmp_path), start=0.5, end=1.25)
    assert len(load_audio(spec)) == 12000 == audio_num_samples(spec, 16000)


@pytest.mark.parametrize("make,category", [
    (lambda p: None, "missing_file"),
    (lambda p: p.write_bytes(b"RIFF\x00\x00garbage" * 10), "corrupt_audio"),
    (lambda p: sf.write(p, np.zeros(0, np.float32), 16000), "empty_audio"),
])
def test_audio_failures_have_categories(tmp_path, make, category):
    p = tmp_path / "x.wav"
    make(p)
    with pytest.raises(SkipSample) as e:
        load_audio(AudioSpec(path=str(p)))
    assert e.value.category == category


def test_frame_estimates():
    conf = DataConfig()
    assert fbank_frames(399, conf) == 0 and fbank_frames(400, conf) == 1 and fbank_frames(16000, conf) == 98
    assert estimate_frames(AudioSpec(num_frames=77), conf) == 77
    assert estimate_frames(AudioSpec(duration=1.0), conf) in (98, 99)   # upper bound: +5 ms margin
    assert estimate_frames(AudioSpec(duration=1.234), conf) >= fbank_frames(int(1.234 * 16000), conf)
    assert estimate_frames(AudioSpec(start=1.0, end=2.0), conf) == estimate_frames(AudioSpec(duration=1.0), conf)
    assert estimate_frames(AudioSpec(), conf) is None


def test_parse_utterance_and_messages(tmp_path):
    rec = parse_json_record(json.dumps({"key": "k", "wav": "a.wav", "txt": "hi", "duration": 1.5}).encode(),
                            "l:1", str(tmp_path))
    assert rec.txt == "hi" and rec.audio[0].duration == 1.5 and rec.messages is None
    msgs = {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "audio", "audio": "a.wav", "duration": 1.0},
                                     {"type": "text", "text": "what was said?"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": {"type": "audio", "audio": "b.wav"}},
        {"role": "assistant", "content": [{"type": "text", "text": "world"}]},
    ]}
    rec = parse_json_record(json.dumps(msgs).encode(), "l:2", str(tmp_path))
    assert rec.key == "l:2" and len(rec.audio) == 2
    assert rec.messages[1].parts == [("audio", 0), ("text", "what was said?")]
    text_only = {"key": "t", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    assert parse_json_record(json.dumps(text_only).encode(), "l:3", "").audio == []


@pytest.mark.parametrize("line,category", [
    (b'{"key": "a", "wav": "a.wav", "txt": "hi"', "malformed_line"),
    (b'["not", "an", "object"]', "malformed_line"),
    (b'{"key": "a", "txt": "no wav"}', "malformed_line"),
    (b'{"key": "a", "wav": "a.wav", "txt": "caf\xe9"}', "bad_encoding"),
    (b'{"key": "a", "wav": "a.wav", "txt": "\\udc80"}', "bad_encoding"),
    (b'{"key": "a", "wav": "a.wav", "txt": ""}', "empty_text"),
    (b'{"key": "a", "wav": "a.wav", "txt": "  \\t "}', "empty_text"),
    (b'{"key": "a", "wav": "a.wav", "txt": 5}', "malformed_line"),
    (b'{"key": "a", "wav": "a.wav", "txt": "x", "duration": -1}', "malformed_line"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "empty_text"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}', "empty_text"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}', "malformed_line"),
])
def test_bad_lines_are_skipped_with_category_and_line(tmp_path, caplog, line, category):
    good = b'{"key": "g", "wav": "g.wav", "txt": "fine"}'
    path = tmp_path / "bad.list"
    path.write_bytes(good + b"\n\n" + line + b"\n" + good.replace(b'"g"', b'"h"') + b"\n")
    stats = DataStats()
    with caplog.at_level(logging.WARNING, logger="west.data"):
        lst = RawList(str(path), stats)
    assert len(lst) == 2 and [lst.record(i).key for i in range(2)] == ["g", "h"]
    assert stats.as_dict() == {category: 1}
    assert f"{path}:3" in caplog.text and category in caplog.text


def test_detect_data_type(tmp_path):
    write_jsonl(tmp_path / "a.list", [{"key": "a"}])
    (tmp_path / "s.list").write_text("/x/shard_000.tar\n")
    (tmp_path / "kaldi").mkdir()
    assert detect_data_type(str(tmp_path / "a.list")) == "raw"
    assert detect_data_type(str(tmp_path / "s.list")) == "shard"
    assert detect_data_type(str(tmp_path / "kaldi")) == "kaldi"
    assert detect_data_type(str(tmp_path / "kaldi" / "feats.scp")) == "kaldi"


def test_config_validation_names_the_key():
    from west.models.config import ConformerConfig

    with pytest.raises(ValueError, match="batch_type"):
        DataConfig(batch_type="bucket")
    with pytest.raises(ValueError, match="pack_tokens"):
        DataConfig(pack_tokens=0)
    with pytest.raises(ValueError, match="packtokens"):
        DataConfig.from_dict({"packtokens": 8192})
    with pytest.raises(ValueError, match="prompt"):
        DataConfig(prompt="no marker here")
    with pytest.raises(ValueError, match="subsampling_rate"):  # geometry is the model's, not a data key
        DataConfig.from_dict({"subsampling_rate": 4})
    with pytest.raises(ValueError, match="subsampling_rate"):
        ConformerConfig(subsampling_rate=5)
    assert DataConfig.from_dict({"batch_type": "pack", "pack_tokens": 512}).pack_tokens == 512
