"""Prompt-only batches for decoding (west.data.generation): same prompt and features as
training, list order, bad input skipped and counted."""
from __future__ import annotations

import numpy as np
import pytest

from west.batch import IGNORE_INDEX
from west.data.config import DataConfig
from west.data.generation import prompt_batches
from west.data.records import AudioSpec, Record
from west.data.stats import DataStats
from west.data.tokenize import PromptEncoder
from west.shapes import SpeechShape

from helpers.corpus import make_wav, write_jsonl


def test_prompts_are_the_training_prefix(corpus, tokenizer):
    conf = DataConfig()
    stats = DataStats()
    rows = corpus["rows"][:7]
    lst = write_jsonl(corpus["dir"] / "gen7.list", rows)
    batches = list(prompt_batches(str(lst), tokenizer, conf, SpeechShape(), 3, stats))
    assert [len(b.keys) for b, _ in batches] == [3, 3, 1]
    assert [k for b, _ in batches for k in b.keys] == [r["key"] for r in rows]
    assert [t for _, refs in batches for t in refs] == [r["txt"] for r in rows]
    enc = PromptEncoder(tokenizer, conf, SpeechShape())
    for b, _ in batches:
        assert (b.labels == IGNORE_INDEX).all() and b.cu_seqlens is None
        lens = b.attention_mask.sum(1)
        assert int(lens.max()) == b.input_ids.shape[1]
        for r, key in enumerate(b.keys):
            rec = next(x for x in rows if x["key"] == key)
            n = int(lens[r])
            frames = int(b.feat_lens[r])
            train = enc.encode(Record(key, "x:1", [AudioSpec()], txt=rec["txt"]), [frames])
            assert b.input_ids[r, :n].tolist() == train.ids[:n]          # the exact training prompt
            assert train.labels[n - 1] != IGNORE_INDEX                    # ... up to the first label
            assert all(l == IGNORE_INDEX for l in train.labels[:n - 1])
            assert (b.attention_mask[r, n:] == 0).all()
            row, start, length = b.speech_spans[r].tolist()
            assert (row, start, length) == (r, train.spans[0][0], train.spans[0][1])
    assert stats.skipped == 0


def test_no_dither_and_bad_input_counted(corpus, tokenizer, tmp_path):
    good = corpus["rows"][:2]
    wav = make_wav(tmp_path / "tiny.wav", 0.02)  # too short for one encoder frame
    rows = [good[0], {"key": "gone", "wav": str(tmp_path / "missing.wav"), "txt": "x"},
            {"key": "short", "wav": str(wav), "txt": "y"}, good[1],
            {"key": "chat", "messages": [{"role": "user", "content": [{"type": "audio", "audio": good[0]["wav"]}]},
                                         {"role": "assistant", "content": "hello world"}]}]
    lst = write_jsonl(tmp_path / "mixed.list", rows)
    stats = DataStats()
    conf = DataConfig(dither=1.0)
    out = list(prompt_batches(str(lst), tokenizer, conf, SpeechShape(), 8, stats))
    (batch, refs), = out
    assert batch.keys == [good[0]["key"], good[1]["key"], "chat"] and refs[-1] == "hello world"
    assert stats.counts["missing_file"] == 1 and stats.counts["too_short"] == 1
    no_dither, = list(prompt_batches(str(lst), tokenizer, DataConfig(dither=0.0), SpeechShape(), 8, DataStats()))
    assert np.array_equal(no_dither[0].feats.numpy(), batch.feats.numpy())  # decoding never dithers
    with pytest.raises(ValueError, match="batch_size"):
        next(prompt_batches(str(lst), tokenizer, conf, SpeechShape(), 0, DataStats()))
