"""Shared fixtures: a tiny tokenizer and tiny audio corpora made on the fly.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on the test
transcripts (west.models.tiny_llm.build_tokenizer), audio is noise written with
soundfile.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from helpers.corpus import make_wav, transcript, write_jsonl
from helpers.threads import torch_threads

# The slowest files, longest first (serial seconds on the 2-core VM: about 230 and 200 for the two halves of
# the gpu_suite test, 2026-11-29; then 150, 110, 100 on 2026-11-28). Under CI's `-n 2 --dist loadfile` a
# worker takes the next file when it is free, and xdist would queue the files by their number of tests: the
# gpu_suite file, 7 minutes in 5 tests, started late and ran on alone. Queued first, its two halves run on the
# two workers beside everything else, and the workers end together.
SLOW_FILES = ("test_tools_gpu_suite.py", "test_tools_gpu_suite_bench.py", "test_train_compile.py",
              "test_bench_benchmark.py", "test_recipes_aishell.py", "test_recipes_librispeech.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):   # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))   # stable: the rest as collected


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
    with torch_threads(1):
        yield


@pytest.fixture
def autocast_check_untraceable(monkeypatch):
    """``torch.amp.is_autocast_available`` breaks a compiled graph, as torch 2.11's dynamo (the GPU
    machines' torch) does: newer releases trace it, so without this CI would not see such a break."""
    import torch

    available = torch.amp.is_autocast_available

    def untraceable(device_type):
        torch._dynamo.graph_break()
        return available(device_type)

    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable)
