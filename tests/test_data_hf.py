"""Hugging Face datasets as data lists (saved to disk, parquet): the same batches as the same
utterances in a jsonl list, conversations from a column, lengths measured once, bad rows counted."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from west.data.config import DataConfig
from west.data.lists import detect_data_type, index_path, open_list
from west.data.stats import DataStats
from west.schema import ConfigError
from west.shapes import SpeechShape

from helpers.corpus import make_wav, write_jsonl
from helpers.same_batches import MODES, assert_same_batches, keys, run

datasets = pytest.importorskip("datasets", reason="the datasets extra reads Hugging Face datasets")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import compute_lengths  # noqa: E402
import data_stats  # noqa: E402

QUESTION = "what was said?"


def audio_dataset(columns: dict):
    """A Dataset whose ``audio`` column is an ``Audio`` feature that does not decode (built without
    torchcodec: the cells are stored as they are, then the column is typed)."""
    ds = datasets.Dataset.from_dict(columns)
    return ds.cast_column("audio", datasets.Audio(decode=False)) if "audio" in columns else ds


def cell(path) -> dict:
    return {"bytes": Path(path).read_bytes(), "path": Path(path).name}


@pytest.fixture(scope="module", autouse=True)
def parquet_cache(tmp_path_factory):
    """datasets' Arrow cache of the parquet files in a temporary folder, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_cache")))
        yield


@pytest.fixture(scope="module")
def hf(corpus, tmp_path_factory):
    """The corpus as a DatasetDict saved to disk (its train split), one parquet file, and a list of
    two parquet files; a copy whose audio is a path column, with a ``sentence`` column and no
    durations; and conversations in a ``messages`` column beside plain rows."""
    d = tmp_path_factory.mktemp("hf")
    rows = corpus["rows"]
    ds = audio_dataset({"audio": [cell(r["wav"]) for r in rows], "text": [r["txt"] for r in rows],
                        "id": [r["key"] for r in rows], "duration": [r["duration"] for r in rows]})
    datasets.DatasetDict(train=ds, test=ds.select(range(4))).save_to_disk(str(d / "dd"))
    ds.to_parquet(str(d / "one.parquet"))
    (d / "parts").mkdir()
    for i, half in enumerate((range(0, 12), range(12, 24))):
        ds.select(half).to_parquet(str(d / "parts" / f"train-{i:05d}-of-00002.parquet"))
    (d / "train.parquet.list").write_text("parts/train-00000-of-00002.parquet\nparts/train-00001-of-00002.parquet\n")
    datasets.Dataset.from_dict({"audio": [r["wav"] for r in rows], "sentence": [r["txt"] for r in rows],
                                "id": [r["key"] for r in rows]}).save_to_disk(str(d / "paths"))
    chat = lambda r: [{"role": "user", "content": [{"type": "audio", "text": None}, {"type": "text", "text": QUESTION}]},  # noqa: E731
                      {"role": "assistant", "content": [{"type": "text", "text": r["txt"]}]}]
    audio_dataset({"audio": [cell(r["wav"]) for r in rows], "text": [r["txt"] for r in rows],
                   "id": [r["key"] for r in rows], "duration": [r["duration"] for r in rows],
                   "messages": [chat(r) if i % 2 else None for i, r in enumerate(rows)]}).save_to_disk(str(d / "chats"))
    chats_jsonl = [{"key": r["key"], "messages": [
        {"role": "user", "content": [{"type": "audio", "audio": r["wav"], "duration": r["duration"]},
                                     {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": r["txt"]}]} if i % 2 else r for i, r in enumerate(rows)]
    return {"dir": d, "disk": d / "dd" / "train", "dict": d / "dd", "parquet": d / "one.parquet",
            "parquet_list": d / "train.parquet.list", "parquet_dir": d / "parts", "paths": d / "paths",
            "chats": d / "chats", "chats_jsonl": write_jsonl(d / "chats.list", chats_jsonl)}


def test_every_form_is_detected(hf):
    for form in ("disk", "dict", "parquet", "parquet_list", "parquet_dir", "paths", "chats"):
        assert detect_data_type(str(hf[form])) == "hf", form


@pytest.mark.parametrize("batch_type", MODES)
def test_a_dataset_gives_the_batches_of_its_jsonl_list(corpus, hf, tokenizer, batch_type):
    want, _ = run(corpus["list"], tokenizer, batch_type=batch_type)
    for form in ("disk", "parquet", "parquet_list"):
        got, ds = run(hf[form], tokenizer, batch_type=batch_type)
        assert ds.stats.skipped == 0, form
        assert_same_batches(got, want)


def test_ranks_and_workers_read_each_row_once(corpus, hf, tokenizer):
    (b0, ds0), (b1, _) = (run(hf["parquet_dir"], tokenizer, rank=r, world_size=2, batch_type="pack", num_workers=2)
                          for r in range(2))
    assert not set(keys(b0)) & set(keys(b1)) and sorted(keys(b0) + keys(b1)) == sorted(corpus["texts"])
    assert len(b0) == len(b1) == len(ds0)
    assert_same_batches(b0, run(corpus["list"], tokenizer, rank=0, world_size=2, batch_type="pack")[0])


def test_resume_mid_epoch_gives_the_rest_of_the_epoch(hf, tokenizer):
    from west.data.dataset import build_dataloader

    conf = DataConfig(batch_type="dynamic", max_tokens_in_batch=200, spec_aug=True)
    full = list(build_dataloader(str(hf["disk"]), tokenizer, conf, SpeechShape(), seed=5, epoch=2)[0])
    loader, ds = build_dataloader(str(hf["disk"]), tokenizer, conf, SpeechShape(), seed=5, epoch=2)
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = ds.state_dict()
    del it
    loader2, ds2 = build_dataloader(str(hf["disk"]), tokenizer, DataConfig(**{**conf.__dict__, "num_workers": 2}),
                                    SpeechShape(), seed=5, epoch=0)
    ds2.load_state_dict(state)
    assert len(full) > 3
    assert_same_batches(list(loader2), full[2:])


def test_without_durations_the_lengths_are_measured_once(corpus, hf, tokenizer, tmp_path):
    """Path cells, a ``sentence`` column: refused until tools/compute_lengths.py wrote the index, then
    planned from exact frame counts like the jsonl list with them."""
    with pytest.raises(ValueError, match=r"compute_lengths.py .*paths"):
        run(hf["paths"], tokenizer)
    assert compute_lengths.main([str(hf["paths"])]) == 0
    assert Path(index_path(str(hf["paths"]))).is_file()
    exact = tmp_path / "exact.list"
    assert compute_lengths.main([str(corpus["list"]), str(exact)]) == 0
    got, ds = run(hf["paths"], tokenizer, batch_type="pack")
    assert ds.stats.skipped == 0
    assert_same_batches(got, run(exact, tokenizer, batch_type="pack")[0])


def test_conversations_from_a_messages_column(hf, tokenizer):
    want, _ = run(hf["chats_jsonl"], tokenizer, batch_type="pack", training=False)
    got, _ = run(hf["chats"], tokenizer, batch_type="pack", training=False)
    assert_same_batches(got, want)


def test_bad_rows_are_counted_naming_the_row(corpus, tokenizer, tmp_path, caplog):
    rows = corpus["rows"]
    good = [cell(r["wav"]) for r in rows[:3]]
    bad_audio = [{"bytes": b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x07" * 40, "path": None},   # corrupt_audio
                 good[0], good[0], None, good[0]]                   # empty text x2, missing_file, malformed_line
    texts = ["a", "b", "c", "hello", "", None, "hello", "hello"]
    durations = [1.0] * 3 + [0.5, 0.5, 0.5, 0.5, -1.0]
    ds = audio_dataset({"audio": good + bad_audio, "text": texts, "duration": durations})
    ds.save_to_disk(str(tmp_path / "bad"))
    with caplog.at_level(logging.WARNING, logger="west.data"):
        got, data = run(tmp_path / "bad", tokenizer, batch_type="pack")
    assert sorted(keys(got)) == ["bad:0", "bad:1", "bad:2"]
    assert data.stats.as_dict() == {"corrupt_audio": 1, "empty_text": 2, "missing_file": 1, "malformed_line": 1}
    for r in range(3, 8):
        assert f"{tmp_path / 'bad'} row {r}" in caplog.text, r
    # a path cell whose file is gone
    datasets.Dataset.from_dict({"audio": [rows[0]["wav"], str(tmp_path / "gone.wav")], "text": ["a", "b"],
                                "duration": [1.0, 1.0]}).save_to_disk(str(tmp_path / "gone"))
    got, data = run(tmp_path / "gone", tokenizer, batch_type="static")
    assert keys(got) == ["gone:0"]
    assert data.stats.as_dict() == {"missing_file": 1}
    # parquet files of one split: one without the text column, one missing; the rest trains
    ds.select(range(3)).to_parquet(str(tmp_path / "good.parquet"))
    ds.select(range(3)).rename_column("text", "words").to_parquet(str(tmp_path / "words.parquet"))
    (tmp_path / "files.list").write_text("good.parquet\nwords.parquet\nnone.parquet\n")
    with caplog.at_level(logging.WARNING, logger="west.data"):
        got, data = run(tmp_path / "files.list", tokenizer, batch_type="static")
    assert sorted(keys(got)) == ["good.parquet:0", "good.parquet:1", "good.parquet:2"]
    assert data.stats.as_dict() == {"malformed_line": 3, "missing_file": 1}
    assert f"{tmp_path / 'words.parquet'} row 0" in caplog.text and "no text column" in caplog.text
    with pytest.raises(ValueError, match=r"no text column .*data.text_column.*words"):   # no file has it
        run(tmp_path / "words.parquet", tokenizer)
    assert run(tmp_path / "words.parquet", tokenizer, text_column="words")[1].stats.skipped == 0


def test_a_path_holding_several_splits_names_the_one_to_give(hf, tmp_path):
    with pytest.raises(ValueError, match=r"splits test, train: give one split's directory, e.g. .*dd/train"):
        open_list(str(hf["dict"]), DataStats())
    (tmp_path / "mixed").mkdir()
    for name in ("train-00000-of-00001.parquet", "test-00000-of-00001.parquet"):
        (tmp_path / "mixed" / name).write_bytes((hf["parquet"]).read_bytes())
    with pytest.raises(ValueError, match=r"several splits \(test, train\).*train-\*.parquet"):
        open_list(str(tmp_path / "mixed"), DataStats())


def test_without_datasets_the_error_names_the_extra(hf, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[datasets\]'"):
        open_list(str(hf["disk"]), DataStats())


def test_data_stats_reads_a_dataset(corpus, hf, tokenizer):
    conf = DataConfig(batch_type="dynamic", max_tokens_in_batch=300)
    want = data_stats.mode_stats(str(corpus["list"]), tokenizer, conf, SpeechShape())
    assert want["utterances"] == 24 and data_stats.mode_stats(str(hf["parquet"]), tokenizer, conf, SpeechShape()) == want


def test_a_dataset_index_is_stale_when_the_data_changes(hf, tokenizer, tmp_path):
    rows = {"audio": [str(make_wav(tmp_path / f"x{i}.wav", 0.5, seed=i)) for i in range(3)], "text": ["hello"] * 3}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "x"))
    assert compute_lengths.main([str(tmp_path / "x")]) == 0
    assert run(tmp_path / "x", tokenizer)[1].stats.skipped == 0
    other = tmp_path / "other" / "x"                      # the same name, a row fewer, the old index
    datasets.Dataset.from_dict({k: v[:2] for k, v in rows.items()}).save_to_disk(str(other))
    Path(index_path(str(other))).write_text(Path(index_path(str(tmp_path / "x"))).read_text())
    with pytest.raises(ValueError, match="rerun"):
        run(other, tokenizer)
