"""Shared fixtures: a tiny tokenizer and tiny audio corpora made on the fly.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on the test
transcripts (west.models.tiny_llm.build_tokenizer), audio is noise written with
soundfile.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

WORDS = ["hello", "world", "speech", "data", "pack", "batch", "token", "model", "audio", "train",
         "你好", "世界", "今天", "天气"]


def make_wav(path, seconds: float, sr: int = 16000, channels: int = 1, subtype: str = "PCM_16",
             seed: int = 0, fmt: str | None = None) -> Path:
    """Write noise audio; returns the path."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sr))
    data = (0.1 * rng.standard_normal((n, channels))).astype(np.float32)
    sf.write(str(path), data if channels > 1 else data[:, 0], sr, subtype=subtype, format=fmt)
    return Path(path)


def write_jsonl(path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return Path(path)


def transcript(i: int) -> str:
    rng = np.random.default_rng(1000 + i)
    return " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), int(rng.integers(1, 6))))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from west.models.tiny_llm import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    texts = [transcript(i) for i in range(200)] + ["Transcribe the speech.", "system user assistant"]
    build_tokenizer(texts, out, vocab_size=400)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """24 utterances of 0.3-1.6 s: (jsonl path with durations, jsonl path without, {key: txt})."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(7)
    rows, texts = [], {}
    for i in range(24):
        secs = float(np.round(rng.uniform(0.3, 1.6), 2))
        key = f"utt{i:03d}"
        wav = make_wav(d / f"{key}.wav", secs, seed=i)
        texts[key] = transcript(i)
        rows.append({"key": key, "wav": str(wav), "txt": texts[key], "duration": secs})
    with_dur = write_jsonl(d / "data.list", rows)
    no_dur = write_jsonl(d / "data_nodur.list", [{k: v for k, v in r.items() if k != "duration"} for r in rows])
    return {"list": with_dur, "list_nodur": no_dur, "texts": texts, "rows": rows, "dir": d}


@pytest.fixture(scope="session")
def list_kinds(corpus, tmp_path_factory):
    """The corpus in every list format the loader reads: {"raw": jsonl, "shard": shard list
    (with its index), "kaldi": Kaldi dir (fbank feats.scp + text + utt2num_frames)}."""
    import kaldiio

    from west.data.config import DataConfig
    from west.data.features import compute_fbank
    from west.prep.shards import make_shards

    d = tmp_path_factory.mktemp("kinds")
    shard_list, n, problems = make_shards(str(corpus["list"]), str(d / "shards"), 5)
    assert n == len(corpus["rows"]) and not problems
    kaldi = d / "kaldi"
    kaldi.mkdir()
    conf = DataConfig()
    with kaldiio.WriteHelper(f"ark,scp:{kaldi}/feats.ark,{kaldi}/feats.scp") as w:
        for r in corpus["rows"]:
            w(r["key"], compute_fbank(sf.read(r["wav"], dtype="float32")[0], conf))
    (kaldi / "text").write_text("".join(f"{k} {t}\n" for k, t in corpus["texts"].items()), encoding="utf-8")
    lens = {k: m.shape[0] for k, m in kaldiio.load_scp(str(kaldi / "feats.scp")).items()}
    (kaldi / "utt2num_frames").write_text("".join(f"{k} {n}\n" for k, n in lens.items()))
    return {"raw": corpus["list"], "shard": Path(shard_list), "kaldi": kaldi}


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny shapes: one intra-op thread is faster and immune to a busy shared CPU."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
