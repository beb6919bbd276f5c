"""Bad input end to end: convert what is convertible, skip and count the rest, in every mode."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import soundfile as sf

from west.batch import COUNTER_NAMES
from west.data.config import DataConfig
from west.data.dataset import build_dataloader as _build
from west.shapes import SpeechShape

from helpers.corpus import make_wav, write_jsonl

SIZES = dict(batch_size=4, max_tokens_in_batch=100, pack_tokens=100)


def build_dataloader(data, tokenizer, conf, **kw):
    return _build(str(data), tokenizer, conf, SpeechShape(), **kw)


@pytest.fixture(scope="module")
def messy(tmp_path_factory):
    """A list mixing good, convertible and broken entries; returns (path, good keys, expected skips)."""
    d = tmp_path_factory.mktemp("messy")
    rows, good = [], []

    def add(key, wav, txt="hello world", duration=1.0, ok=True):
        rows.append({"key": key, "wav": str(wav), "txt": txt, "duration": duration})
        if ok:
            good.append(key)

    for i in range(4):
        add(f"good{i}", make_wav(d / f"good{i}.wav", 0.8 + 0.1 * i, seed=i), duration=0.8 + 0.1 * i)
    # valid but unusual: converted, never skipped
    add("pcm8", make_wav(d / "pcm8.wav", 0.7, subtype="PCM_U8"), duration=0.7)
    add("pcm24", make_wav(d / "pcm24.wav", 0.7, subtype="PCM_24"), duration=0.7)
    add("flac", make_wav(d / "f.flac", 0.7, fmt="FLAC"), duration=0.7)
    add("stereo44k", make_wav(d / "st.wav", 0.7, sr=44100, channels=2), duration=0.7)
    # broken: the list claims a duration, decoding finds the problem
    add("missing", d / "nope.wav", ok=False)
    (d / "corrupt.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x07" * 40)
    add("corrupt", d / "corrupt.wav", ok=False)
    sf.write(d / "empty.wav", np.zeros(0, np.float32), 16000)
    add("empty", d / "empty.wav", ok=False)                                    # the list says 1 s
    add("empty0", d / "empty.wav", duration=0.0, ok=False)                     # the list says 0 s
    add("tiny", make_wav(d / "tiny.wav", 0.02), duration=0.02, ok=False)         # < one encoder frame
    add("notext", make_wav(d / "nt.wav", 0.5), txt="", ok=False)
    add("blank", make_wav(d / "bl.wav", 0.5), txt="  \t", ok=False)
    add("long", make_wav(d / "long.wav", 10.0), duration=10.0, ok=False)       # > pack_tokens / budget
    whole = make_wav(d / "whole.wav", 0.8).read_bytes()
    (d / "cut.wav").write_bytes(whole[: len(whole) // 2])  # a copy cut short: libsndfile reads half, silently
    add("cut", d / "cut.wav", duration=0.8, ok=False)
    path = write_jsonl(d / "data.list", rows)
    with open(path, "ab") as f:
        f.write(b'{"key": "latin1", "wav": "x.wav", "txt": "caf\xe9"}\n')
        f.write(b'{"key": "broken", "wav": "x.wav", "txt": \n')
    # a zero-length wav is empty_audio whether the list knows it (empty0) or decoding finds it (empty)
    skips = {"missing_file": 1, "corrupt_audio": 1, "empty_audio": 2, "too_short": 1, "empty_text": 2,
             "too_long": 1, "bad_encoding": 1, "malformed_line": 1, "truncated_audio": 1}
    return path, good, skips


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_type", ["static", "dynamic", "pack"])
def test_bad_input_is_skipped_and_counted(messy, tokenizer, caplog, batch_type, num_workers):
    path, good, skips = messy
    conf = DataConfig(batch_type=batch_type, num_workers=num_workers, **SIZES)
    if batch_type == "static":
        conf = dataclasses.replace(conf, max_duration=8.0)    # static has no token budget: the duration filter drops 'long'
    with caplog.at_level(logging.WARNING, logger="west.data"):
        loader, ds = build_dataloader(str(path), tokenizer, conf)
        batches = list(loader)
    assert sorted(k for b in batches for k in b.keys) == sorted(good)
    assert {k: v for k, v in ds.stats.as_dict().items() if k in skips} == skips
    assert ds.stats.skipped == sum(skips.values())
    # one warning per bad entry naming its list line (worker processes log on their own stderr)
    for lineno in range(9, 20) if num_workers == 0 else ():
        assert caplog.text.count(f"{path}:{lineno} ") + caplog.text.count(f"{path}:{lineno}\n") >= 1, lineno
    assert f"skipped {sum(skips.values())} utterance(s)" in caplog.text


def test_bad_lines_are_counted_per_list(messy, corpus, tokenizer, caplog):
    path, good, skips = messy
    conf = DataConfig(batch_type="pack", weights=[1, 1], **SIZES)
    with caplog.at_level(logging.WARNING, logger="west.data"):
        loader, ds = build_dataloader(f"{corpus['list']},{path}", tokenizer, conf)
    per_list = {p: st.as_dict() for p, st in ds.list_skips}
    assert per_list[str(corpus["list"])] == {}
    # what the list itself shows: unparsable lines, empty text, lengths out of range
    assert per_list[str(path)] == {"bad_encoding": 1, "malformed_line": 1, "empty_text": 2, "too_short": 1,
                                   "too_long": 1, "empty_audio": 1}
    assert f"list {path}: skipped 7 utterance(s)" in caplog.text


def test_a_list_without_lengths_is_refused_naming_the_tool(corpus, tokenizer):
    with pytest.raises(ValueError, match=r"data_nodur.list:1: .*compute_lengths.py"):
        build_dataloader(corpus["list_nodur"], tokenizer, DataConfig(batch_type="pack", **SIZES))


def test_all_bad_planned_batch_becomes_a_dummy(tmp_path, tokenizer):
    good = [make_wav(tmp_path / f"g{i}.wav", 0.5, seed=i) for i in range(2)]
    rows = [{"key": "b0", "wav": str(tmp_path / "no0.wav"), "txt": "x", "duration": 0.5},
            {"key": "b1", "wav": str(tmp_path / "no1.wav"), "txt": "x", "duration": 0.5}]
    rows += [{"key": f"g{i}", "wav": str(p), "txt": "hello", "duration": 0.5} for i, p in enumerate(good)]
    path = write_jsonl(tmp_path / "d.list", rows)
    conf = DataConfig(batch_type="static", batch_size=2)
    per_rank = []
    for rank in range(2):
        loader, ds = build_dataloader(str(path), tokenizer, conf, rank=rank, world_size=2, training=False)
        per_rank.append(list(loader))
        assert len(per_rank[-1]) == len(ds) == 1
    dummy, real = per_rank[0][0], per_rank[1][0]
    assert dummy.keys == [] and all(dummy.counters[k] == 0 for k in COUNTER_NAMES)
    assert (dummy.labels == -100).all() and dummy.feats.abs().sum() == 0
    assert real.keys == ["g0", "g1"]


@pytest.mark.parametrize("batch_type", ["static", "pack"])
def test_dummy_batch_shape(tokenizer, corpus, batch_type):
    conf = DataConfig(batch_type=batch_type, pack_tokens=64)
    _, ds = build_dataloader(str(corpus["list"]), tokenizer, conf)
    b = ds.dummy_batch()
    assert b.speech_spans.tolist() == [[0, 0, 1]] and b.feat_lens.tolist() == [7]
    if batch_type == "pack":   # 3 tokens, trimmed to pack_pad_multiple (8): one 5-token dummy tail
        assert b.input_ids.shape == (1, 8) and b.cu_seqlens.tolist() == [0, 3, 8]
        assert b.position_ids[0, 3:].tolist() == list(range(5))
        fixed = build_dataloader(str(corpus["list"]), tokenizer, dataclasses.replace(conf, pack_pad_multiple=0))[1].dummy_batch()
        assert fixed.input_ids.shape == (1, 64) and fixed.cu_seqlens.tolist() == [0, 3, 64]
    else:
        assert b.input_ids.shape == (1, 3) and b.attention_mask.tolist() == [[1, 1, 1]]


def test_wrong_durations_never_overflow_a_pack(tmp_path, tokenizer):
    """Metadata that under-states a length costs an extra row, never a truncation or a lost sample."""
    rows = [{"key": f"u{i}", "wav": str(make_wav(tmp_path / f"u{i}.wav", 1.5, seed=i)), "txt": "hello world",
             "duration": 0.3} for i in range(6)]
    path = write_jsonl(tmp_path / "lies.list", rows)
    loader, ds = build_dataloader(str(path), tokenizer, DataConfig(batch_type="pack", pack_tokens=128))
    batches = list(loader)
    assert sorted(k for b in batches for k in b.keys) == [f"u{i}" for i in range(6)]
    assert ds.stats.counts["plan_overflow"] >= 1
    assert all(b.input_ids.shape[1] <= 128 for b in batches) and any(b.input_ids.shape[0] > 1 for b in batches)
    for b in batches:   # every row fits the batch width: nothing truncated
        assert b.counters["real_llm_tokens"] <= b.input_ids.numel()
