"""Lhotse cuts and Shar as data lists: the same epoch as the same utterances in a jsonl list (every
batch mode, ranks, workers, resume), lhotse-only cuts decoded by lhotse, bad input counted."""
from __future__ import annotations

import gzip
import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from west.data.config import DataConfig
from west.data.dataset import build_dataloader
from west.data.features import load_audio
from west.data.lists import detect_data_type, index_path, open_list
from west.data.stats import DataStats
from west.schema import ConfigError
from west.shapes import SpeechShape

from helpers.corpus import make_wav, transcript, write_jsonl
from helpers.same_batches import MODES, assert_same_batches, keys, loss, run, tiny_model

pytest.importorskip("lhotse", reason="the lhotse extra reads Lhotse manifests")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import compute_lengths  # noqa: E402
import data_stats  # noqa: E402

QUESTION = "what was said?"


def _stereo(path, seconds, seed):
    data = (0.1 * np.random.default_rng(seed).standard_normal((int(seconds * 16000), 2))).astype(np.float32)
    sf.write(str(path), data, 16000, subtype="PCM_16")
    return sf.read(str(path), dtype="float32")[0]    # as decoded: PCM_16 values


@pytest.fixture(scope="module")
def cuts(tmp_path_factory):
    """A CutSet from generated audio, in every Lhotse form, and the same utterances as a jsonl list:
    two cuts of one long recording (one with two supervisions, given out of order), a cut on channel
    1 of a stereo recording, a two-channel cut (mixed down), an 8 kHz recording, a conversation
    (``custom`` messages) and plain one-recording cuts."""
    from lhotse import CutSet, MonoCut, MultiCut, Recording, RecordingSet, SupervisionSegment, SupervisionSet

    d = tmp_path_factory.mktemp("lhotse")
    sup = lambda i, rec, start, dur, text, ch=0: SupervisionSegment(f"s{i}", rec, start, dur, channel=ch, text=text)  # noqa: E731
    long = Recording.from_file(make_wav(d / "long.wav", 3.0, seed=99))
    stereo_data = _stereo(d / "stereo.wav", 1.2, 5)
    stereo = Recording.from_file(d / "stereo.wav")
    sf.write(d / "ch1.wav", stereo_data[:, 1], 16000, subtype="FLOAT")
    sf.write(d / "mix.wav", stereo_data.mean(axis=1, dtype=np.float32), 16000, subtype="FLOAT")
    low = Recording.from_file(make_wav(d / "low.wav", 0.9, sr=8000, seed=7))
    cut_list = [
        MonoCut("a", 0.5, 1.0, 0, recording=long, supervisions=[sup(0, "long", 0.0, 1.0, transcript(0))]),
        MonoCut("b", 1.75, 1.15, 0, recording=long, supervisions=[sup(2, "long", 0.6, 0.55, transcript(2)),
                                                                    sup(1, "long", 0.0, 0.6, transcript(1))]),
        MonoCut("c", 0.0, 1.2, 1, recording=stereo, supervisions=[sup(3, stereo.id, 0.0, 1.2, transcript(3), 1)]),
        MultiCut("m", 0.25, 0.75, [0, 1], recording=stereo, supervisions=[sup(4, stereo.id, 0, 0.75, transcript(4), [0, 1])]),
        MonoCut("low", 0.0, 0.9, 0, recording=low, supervisions=[sup(5, low.id, 0.0, 0.9, transcript(5))]),
        MonoCut("conv", 0.25, 1.5, 0, recording=long, supervisions=[],
                custom={"messages": [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]},
                                     {"role": "assistant", "content": transcript(6)}]}),
    ]
    rows = [{"key": "a", "wav": str(d / "long.wav"), "start": 0.5, "end": 1.5, "duration": 1.0, "txt": transcript(0)},
            {"key": "b", "wav": str(d / "long.wav"), "start": 1.75, "end": 2.9, "duration": 1.15,
             "txt": f"{transcript(1)} {transcript(2)}"},
            {"key": "c", "wav": str(d / "ch1.wav"), "duration": 1.2, "txt": transcript(3)},
            {"key": "m", "wav": str(d / "mix.wav"), "start": 0.25, "end": 1.0, "duration": 0.75, "txt": transcript(4)},
            {"key": "low", "wav": str(d / "low.wav"), "duration": 0.9, "txt": transcript(5)},
            {"key": "conv", "messages": [
                {"role": "user", "content": [{"type": "audio", "audio": str(d / "long.wav"), "start": 0.25, "end": 1.75,
                                              "duration": 1.5}, {"type": "text", "text": QUESTION}]},
                {"role": "assistant", "content": transcript(6)}]}]
    for i in range(8):
        secs = round(0.4 + 0.15 * i, 2)
        rec = Recording.from_file(make_wav(d / f"u{i}.wav", secs, seed=i))
        cut_list.append(MonoCut(f"u{i}", 0.0, secs, 0, recording=rec, supervisions=[sup(10 + i, rec.id, 0, secs, transcript(10 + i))]))
        rows.append({"key": f"u{i}", "wav": str(d / f"u{i}.wav"), "duration": secs, "txt": transcript(10 + i)})
    cutset = CutSet.from_cuts(cut_list)
    cutset.to_file(d / "cuts.jsonl.gz")
    (d / "shar").mkdir()
    cutset.to_shar(str(d / "shar"), fields={"recording": "flac"}, shard_size=5)
    assert compute_lengths.main([str(d / "shar")]) == 0
    # the recordings + supervisions a recipe writes: one sample per supervision
    RecordingSet.from_recordings([long, stereo]).to_file(d / "demo_recordings_train.jsonl.gz")
    SupervisionSet.from_segments([sup(0, "long", 0.5, 1.0, transcript(0)), sup(1, "long", 1.75, 0.6, transcript(1)),
                                  sup(3, stereo.id, 0.0, 1.2, transcript(3), 1)]).to_file(d / "demo_supervisions_train.jsonl.gz")
    pair = write_jsonl(d / "pair.list", [
        {"key": "s0", "wav": str(d / "long.wav"), "start": 0.5, "end": 1.5, "duration": 1.0, "txt": transcript(0)},
        {"key": "s1", "wav": str(d / "long.wav"), "start": 1.75, "end": 2.35, "duration": 0.6, "txt": transcript(1)},
        {"key": "s3", "wav": str(d / "ch1.wav"), "duration": 1.2, "txt": transcript(3)}])
    return {"dir": d, "cuts": d / "cuts.jsonl.gz", "shar": d / "shar", "jsonl": write_jsonl(d / "data.list", rows),
            "recordings": d / "demo_recordings_train.jsonl.gz", "supervisions": d / "demo_supervisions_train.jsonl.gz",
            "pair_jsonl": pair, "keys": [r["key"] for r in rows], "cutset": cutset}


@pytest.fixture(scope="module")
def model(tokenizer, one_torch_thread):
    return tiny_model(tokenizer)


def test_every_lhotse_form_is_detected(cuts, tmp_path):
    plain = tmp_path / "cuts.jsonl"
    plain.write_bytes(gzip.decompress(cuts["cuts"].read_bytes()))
    for path in (cuts["cuts"], plain, cuts["recordings"], cuts["supervisions"]):
        assert detect_data_type(str(path)) == "lhotse", path
    assert detect_data_type(str(cuts["shar"])) == "shar"
    assert detect_data_type(str(cuts["jsonl"])) == "raw"


@pytest.mark.parametrize("batch_type", MODES)
def test_cuts_and_shar_train_like_the_jsonl_list(cuts, tokenizer, model, batch_type):
    """The same samples in the same batches (features with their dither and SpecAugment included),
    hence the same loss, in every batch mode."""
    shape = model.cfg.speech_shape()
    want, ds = run(cuts["jsonl"], tokenizer, shape, batch_type=batch_type)
    assert sorted(keys(want)) == sorted(cuts["keys"]) and ds.stats.skipped == 0
    ref = loss(model, want)
    for kind in ("cuts", "shar"):
        got, ds = run(cuts[kind], tokenizer, shape, batch_type=batch_type)
        assert ds.stats.skipped == 0, kind
        assert_same_batches(got, want)
        assert loss(model, got) == ref, kind


@pytest.mark.parametrize("kind", ["cuts", "shar"])
def test_ranks_and_workers_read_each_cut_once(cuts, tokenizer, kind):
    per_rank = [run(cuts[kind], tokenizer, rank=r, world_size=2, batch_type="dynamic", num_workers=2)
                for r in range(2)]
    (b0, ds0), (b1, _) = per_rank
    assert not set(keys(b0)) & set(keys(b1))
    assert sorted(keys(b0) + keys(b1)) == sorted(cuts["keys"])
    assert len(b0) == len(b1) == len(ds0)
    want, _ = run(cuts["jsonl"], tokenizer, rank=1, world_size=2, batch_type="dynamic")
    assert_same_batches(b1, want)


@pytest.mark.parametrize("kind,batch_type", [("cuts", "static"), ("shar", "pack")])
def test_resume_mid_epoch_gives_the_rest_of_the_epoch(cuts, tokenizer, kind, batch_type):
    conf = DataConfig(batch_type=batch_type, batch_size=3, pack_tokens=160, spec_aug=True)
    full = list(build_dataloader(str(cuts[kind]), tokenizer, conf, SpeechShape(), seed=5, epoch=2)[0])
    loader, ds = build_dataloader(str(cuts[kind]), tokenizer, conf, SpeechShape(), seed=5, epoch=2)
    it = iter(loader)
    next(it)
    state = ds.state_dict()
    del it
    loader2, ds2 = build_dataloader(str(cuts[kind]), tokenizer, DataConfig(**{**conf.__dict__, "num_workers": 2}),
                                    SpeechShape(), seed=5, epoch=0)
    ds2.load_state_dict(state)
    assert len(full) > 2
    assert_same_batches(list(loader2), full[1:])


@pytest.mark.parametrize("given", ["recordings", "supervisions"])
def test_recordings_and_supervisions_give_one_sample_per_supervision(cuts, tokenizer, given):
    got, ds = run(cuts[given], tokenizer, batch_type="static", training=False)
    want, _ = run(cuts["pair_jsonl"], tokenizer, batch_type="static", training=False)
    assert keys(got) == ["s0", "s1", "s3"] and ds.stats.skipped == 0
    assert_same_batches(got, want)


def test_cuts_west_cannot_read_itself_are_loaded_by_lhotse(cuts, tmp_path):
    """A padded cut (a MixedCut) and a speed-perturbed one keep their manifest; lhotse loads them."""
    from lhotse import CutSet

    a = cuts["cutset"]["a"]
    special = CutSet.from_cuts([a.pad(duration=1.5).with_id("padded"), a.perturb_speed(1.1)])
    special.to_file(tmp_path / "special.jsonl.gz")
    source = open_list(str(tmp_path / "special.jsonl.gz"), DataStats())
    for i, cut in enumerate(special):
        rec = source.record(i)
        assert rec.key == cut.id and rec.txt == transcript(0) and rec.audio[0].cut is not None
        np.testing.assert_array_equal(load_audio(rec.audio[0]), cut.load_audio()[0])


def _bad_cuts(d: Path, cutset) -> tuple[Path, dict]:
    """A manifest of good and broken cuts, and the skips it must give."""
    from lhotse import AudioSource, MonoCut, Recording, SupervisionSegment, fastcopy

    good = [cutset["u0"], cutset["u1"]]
    short = Recording.from_file(make_wav(d / "short.wav", 0.5, seed=3))
    at = lambda name, **kw: fastcopy(short, id=name, sources=[AudioSource("file", [0], str(d / name))], **kw)  # noqa: E731
    claimed = at("short.wav", duration=2.0, num_samples=32000)                     # the manifest says 2 s
    (d / "garbage.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x07" * 40)
    garbage, gone = at("garbage.wav"), at("gone.wav")

    def cut(cid, rec, start, dur, text="hello world"):
        return MonoCut(cid, start, dur, 0, recording=rec,
                       supervisions=[SupervisionSegment(f"s-{cid}", rec.id if rec else "x", 0, dur, text=text)])

    lines = [json.dumps(c.to_dict()) for c in good] + [
        json.dumps(cut("gone", gone, 0.0, 0.5).to_dict()),                  # missing_file (decode)
        json.dumps(cut("past", short, 0.2, 0.6).to_dict()),                 # truncated_audio: past the recording
        json.dumps(cut("shorter", claimed, 0.0, 1.5).to_dict()),            # truncated_audio: the file is shorter
        json.dumps(cut("garbage", garbage, 0.0, 0.5).to_dict()),            # corrupt_audio (decode)
        json.dumps(cut("silent", short, 0.0, 0.5, text=" ").to_dict()),     # empty_text
        '{"id": "broken", "start": 0',                                      # malformed_line
        json.dumps(short.to_dict()),                                        # malformed_line: not a cut
        json.dumps({k: v for k, v in cut("norec", short, 0.0, 0.5).to_dict().items() if k != "recording"}),  # no audio
    ]
    path = d / "bad_cuts.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return path, {"missing_file": 2, "truncated_audio": 2, "corrupt_audio": 1, "empty_text": 1, "malformed_line": 2}


def test_bad_cuts_are_counted_naming_their_line(cuts, tokenizer, tmp_path, caplog):
    path, skips = _bad_cuts(tmp_path, cuts["cutset"])
    with caplog.at_level(logging.WARNING, logger="west.data"):
        got, ds = run(path, tokenizer, batch_type="pack")
    assert sorted(keys(got)) == ["u0", "u1"]
    assert {k: v for k, v in ds.stats.as_dict().items() if k in skips} == skips and ds.stats.skipped == 8
    for lineno in range(3, 11):
        assert f"{path}:{lineno}" in caplog.text, lineno


def test_shar_index_is_written_checked_and_counts_a_missing_tar(cuts, tokenizer, tmp_path, capsys):
    shar = tmp_path / "shar"
    shutil.copytree(cuts["shar"], shar)
    assert not Path(index_path(str(shar))).exists()          # beside the directory: a copy has none
    assert sorted(p.name for p in shar.iterdir()) == sorted(p.name for p in cuts["shar"].iterdir())
    with pytest.raises(ValueError, match=r"compute_lengths.py .*shar"):
        run(shar, tokenizer)
    (shar / "recording.000001.tar").unlink()                 # cuts 5..9 lose their audio
    (shar / "west.idx").write_text("{}\n")                    # where an earlier west kept its index: named
    assert compute_lengths.main([str(shar)]) == 0
    assert f"{shar / 'west.idx'} is an index an earlier west wrote inside the directory" in capsys.readouterr().err
    (shar / "west.idx").unlink()
    got, ds = run(shar, tokenizer, batch_type="pack")
    lost = cuts["keys"][5:10]
    assert sorted(keys(got)) == sorted(k for k in cuts["keys"] if k not in lost)
    assert ds.stats.as_dict() == {"missing_file": 5}
    with open(shar / "recording.000000.tar", "ab") as f:     # rewritten after indexing: stale
        f.write(b"\0" * 512)
    with pytest.raises(ValueError, match="changed since"):
        run(shar, tokenizer)


def test_without_lhotse_the_error_names_the_extra(cuts, monkeypatch):
    monkeypatch.setitem(sys.modules, "lhotse", None)
    for path in (cuts["cuts"], cuts["shar"]):
        with pytest.raises(ConfigError, match=r"pip install -e '\.\[lhotse\]'"):
            open_list(str(path), DataStats())


def test_data_stats_reads_cuts_and_shar(cuts, tokenizer):
    conf = DataConfig(batch_type="pack", pack_tokens=400)
    want = data_stats.mode_stats(str(cuts["jsonl"]), tokenizer, conf, SpeechShape())
    assert want["utterances"] == len(cuts["keys"])
    for kind in ("cuts", "shar"):
        assert data_stats.mode_stats(str(cuts[kind]), tokenizer, conf, SpeechShape()) == want
