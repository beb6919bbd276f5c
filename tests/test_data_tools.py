"""Data tools and the other input formats: Kaldi dirs, shards, CMVN, lengths, stats."""
from __future__ import annotations

import io
import json
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from west.data.config import DataConfig
from west.data.dataset import build_dataloader as _build
from west.data.features import compute_fbank
from west.data.lists import index_path
from west.shapes import SpeechShape

from helpers.corpus import make_wav, write_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import compute_cmvn  # noqa: E402
import compute_lengths  # noqa: E402
import data_stats  # noqa: E402
import make_data_list  # noqa: E402
import make_shard_list  # noqa: E402


def build_dataloader(data, tokenizer, conf, **kw):
    return _build(str(data), tokenizer, conf, SpeechShape(), **kw)


def all_keys(batches):
    return [k for b in batches for k in b.keys]


def test_make_data_list_with_and_without_segments(tmp_path, tokenizer):
    for i in range(3):
        make_wav(tmp_path / f"r{i}.wav", 1.0 + i * 0.5, seed=i)
    (tmp_path / "wav.scp").write_text("".join(f"r{i} {tmp_path}/r{i}.wav\n" for i in range(3)))
    (tmp_path / "text").write_text("r0 hello world\nr1 data pack\n")          # r2 has no transcript
    out = tmp_path / "data.list"
    make_data_list.main(["--wav_scp", str(tmp_path / "wav.scp"), "--text", str(tmp_path / "text"),
                         "--compute_duration", str(out)])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["key"] for r in rows] == ["r0", "r1"] and rows[1]["duration"] == 1.5
    (tmp_path / "segments").write_text("s0 r2 0.00 0.80\ns1 r2 0.80 2.00\n")
    (tmp_path / "text").write_text("s0 hello\ns1 world today\n")
    make_data_list.main(["--wav_scp", str(tmp_path / "wav.scp"), "--text", str(tmp_path / "text"),
                         "--segments", str(tmp_path / "segments"), str(out)])
    loader, ds = build_dataloader(str(out), tokenizer, DataConfig(batch_type="static", batch_size=8), training=False)
    (batch,) = list(loader)
    assert len(ds) == 1 and batch.keys == ["s0", "s1"]
    assert batch.feat_lens.tolist() == [78, 118]        # 0.8 s and 1.2 s cut from the recording


def test_shards_round_trip_and_bad_shards(tmp_path, corpus, tokenizer):
    shard_list, n, problems = make_shard_list.make_shards(str(corpus["list"]), str(tmp_path / "shards"), 5)
    assert n == 24 and not problems
    shards = Path(shard_list).read_text().split()
    assert len(shards) == 5
    with tarfile.open(shards[0]) as t:
        names = t.getnames()
    assert names[:2] == [f"{corpus['rows'][0]['key']}.txt", f"{corpus['rows'][0]['key']}.wav"]
    # a WeNet shard list (no index) mixing good shards with a missing one, a garbage one and one
    # with a non-UTF-8 transcript: refused until compute_lengths.py has indexed it
    (tmp_path / "garbage.tar").write_bytes(b"\x00garbage" * 100)
    with tarfile.open(tmp_path / "latin1.tar", "w") as t:
        for name, data in [("bad.txt", b"caf\xe9"), ("bad.wav", (corpus["dir"] / "utt000.wav").read_bytes())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    lst = tmp_path / "all.list"
    lst.write_text("\n".join(shards + [str(tmp_path / "nope.tar"), str(tmp_path / "garbage.tar"),
                                       str(tmp_path / "latin1.tar")]) + "\n")
    with pytest.raises(ValueError, match="compute_lengths.py"):
        build_dataloader(lst, tokenizer, DataConfig(batch_type="pack", pack_tokens=400))
    assert compute_lengths.main([str(lst)]) == 0 and Path(index_path(str(lst))).is_file()
    for batch_type in ("static", "pack"):
        loader, ds = build_dataloader(lst, tokenizer, DataConfig(batch_type=batch_type, pack_tokens=400))
        batches = list(loader)
        assert len(batches) == len(ds) and Counter(all_keys(batches)) == Counter(list(corpus["texts"]))
        assert ds.stats.as_dict() == {"missing_file": 1, "corrupt_audio": 1, "bad_encoding": 1}
    # planned shards are split over ranks x workers: disjoint, complete, equal steps
    seen = []
    for rank in range(2):
        conf = DataConfig(batch_type="dynamic", max_tokens_in_batch=300, num_workers=2)
        loader, ds = build_dataloader(lst, tokenizer, conf, rank=rank, world_size=2)
        seen.append(all_keys(loader))
        assert len(ds) == len(build_dataloader(lst, tokenizer, conf, rank=1 - rank, world_size=2)[1])
    assert not set(seen[0]) & set(seen[1]) and Counter(seen[0] + seen[1]) == Counter(list(corpus["texts"]))
    # a shard rewritten after indexing makes the index stale: refused, never wrong audio
    with open(shards[0], "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(ValueError, match="changed since"):
        build_dataloader(lst, tokenizer, DataConfig(batch_type="pack", pack_tokens=400))


def test_compute_cmvn_matches_features_and_normalises(tmp_path, corpus, tokenizer):
    out = tmp_path / "cmvn.json"
    compute_cmvn.main([str(corpus["list"]), str(out)])
    stats = json.loads(out.read_text())
    import soundfile as sf

    feats = np.concatenate([compute_fbank(sf.read(r["wav"], dtype="float32")[0], DataConfig())
                            for r in corpus["rows"]])
    assert stats["frame_num"] == feats.shape[0]
    np.testing.assert_allclose(np.array(stats["mean_stat"]) / feats.shape[0], feats.mean(0), rtol=1e-4, atol=1e-4)
    conf = DataConfig(batch_type="pack", pack_tokens=400, cmvn=str(out), dither=0.0)
    loader, _ = build_dataloader(str(corpus["list"]), tokenizer, conf)
    normed = torch.cat([b.feats for b in loader])
    assert normed.shape[0] == feats.shape[0]
    assert normed.mean(0).abs().max() < 1e-3 and (normed.std(0) - 1).abs().max() < 1e-2


def test_compute_lengths_gives_exact_frames(tmp_path, tokenizer):
    wavs = [make_wav(tmp_path / "a.wav", 1.234), make_wav(tmp_path / "b.wav", 0.777, sr=44100, channels=2),
            make_wav(tmp_path / "c.flac", 2.0, sr=8000, fmt="FLAC")]
    rows = [{"key": p.stem, "wav": str(p), "txt": "hello"} for p in wavs]
    rows.append({"key": "conv", "messages": [
        {"role": "user", "content": [{"type": "audio", "audio": str(wavs[0])}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"}]})
    rows.append({"key": "gone", "wav": str(tmp_path / "gone.wav"), "txt": "x"})
    src = write_jsonl(tmp_path / "in.list", rows)
    out = tmp_path / "out.list"
    assert compute_lengths.main([str(src), str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 5 and "num_frames" not in lines[4]          # unreadable line kept as is
    frames = {r["key"]: r["num_frames"] for r in lines[:3]}
    assert lines[3]["messages"][0]["content"][0]["num_frames"] == frames["a"]
    compute_lengths.main([str(src), str(out), "--drop_bad"])
    loader, ds = build_dataloader(str(out), tokenizer, DataConfig(batch_type="static", batch_size=8), training=False)
    (batch,) = list(loader)
    assert len(ds) == 1
    assert dict(zip(batch.keys, batch.feat_lens.tolist()[:3])) == frames


@pytest.mark.parametrize("with_lengths", [True, False])
def test_kaldi_feats_scp(tmp_path, tokenizer, with_lengths):
    import kaldiio

    rng = np.random.default_rng(0)
    mats = {f"k{i}": rng.standard_normal((40 + 13 * i, 80)).astype(np.float32) for i in range(5)}
    with kaldiio.WriteHelper(f"ark,scp:{tmp_path}/feats.ark,{tmp_path}/feats.scp") as w:
        for k, m in mats.items():
            w(k, m)
    (tmp_path / "text").write_text("".join(f"{k} hello world\n" for k in mats if k != "k4") + "k4  \n")
    conf = DataConfig(batch_type="pack", pack_tokens=200, spec_aug=False)
    if with_lengths:
        (tmp_path / "utt2num_frames").write_text("".join(f"{k} {m.shape[0]}\n" for k, m in mats.items()))
    else:   # refused with the tool to run, which writes utt2num_frames from the matrices
        with pytest.raises(ValueError, match="compute_lengths.py"):
            build_dataloader(tmp_path, tokenizer, conf)
        assert compute_lengths.main([str(tmp_path)]) == 0
    loader, ds = build_dataloader(str(tmp_path), tokenizer, conf)
    batches = list(loader)
    assert len(batches) == len(ds) and ds.stats.as_dict() == {"empty_text": 1}
    got = {}
    for b in batches:
        for k, f in zip(b.keys, torch.split(b.feats, b.feat_lens.tolist())):
            got[k] = f.numpy()
    assert sorted(got) == ["k0", "k1", "k2", "k3"]
    for k, f in got.items():
        np.testing.assert_array_equal(f, mats[k])


def test_conversations_and_text_only_samples_pack_with_speech(tmp_path, corpus, tokenizer):
    wav = corpus["rows"][0]["wav"]
    conv = [
        {"key": "chat", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "audio", "audio": wav, "duration": 1.0}, "what was said?"]},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and in short?"},
            {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]},
        {"key": "text", "messages": [{"role": "user", "content": "say hello"},
                                     {"role": "assistant", "content": "hello"}]},
    ]
    path = write_jsonl(tmp_path / "mix.list", corpus["rows"][:4] + conv)
    loader, ds = build_dataloader(str(path), tokenizer, DataConfig(batch_type="pack", pack_tokens=512))
    (batch,) = list(loader)
    assert sorted(batch.keys) == sorted([r["key"] for r in corpus["rows"][:4]] + ["chat", "text"])
    assert len(batch.feat_lens) == 5                       # 4 utterances + 1 audio turn; the text sample has none
    labelled = tokenizer.decode(batch.labels[batch.labels != -100])
    assert "hello<|im_end|>hi<|im_end|>" in labelled and "what was said" not in labelled


def test_data_stats_tool(tmp_path, corpus, tokenizer_dir, capsys):
    out = tmp_path / "stats.json"
    data_stats.main([str(corpus["list"]), "--tokenizer", str(tokenizer_dir), "--batch_size", "5",
                     "--max_tokens_in_batch", "300", "--pack_tokens", "400", "--json", str(out)])
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert set(rows) == {"static", "dynamic", "pack", "pack (encoder padded)"}
    for mode, r in rows.items():
        assert r["utterances"] == 24 and 0 < r["llm_ratio"] <= 1 and 0 < r["enc_ratio"] <= 1
        assert f"| {mode} | {r['batches']} |" in table
    assert rows["pack"]["enc_ratio"] == 1.0 and rows["pack (encoder padded)"]["enc_ratio"] < 1.0
    from transformers import AutoTokenizer

    loader, _ = build_dataloader(str(corpus["list"]), AutoTokenizer.from_pretrained(str(tokenizer_dir)),
                                 DataConfig(batch_type="dynamic", max_tokens_in_batch=300))
    assert rows["dynamic"]["batches"] == len(list(loader))
