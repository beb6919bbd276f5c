"""Cuts without audio read by their precomputed Lhotse features (a cut manifest pointing at its own
feature storage, or a Shar directory holding only features): the same epoch, batch for batch, as a
Kaldi feats.scp list of the same matrices; lilcom members decoded exactly as lhotse decodes them;
bad members counted; settings that cannot match refused up front."""
from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from west.data.lists import open_list
from west.data.stats import DataStats
from west.schema import ConfigError
from west.shapes import SpeechShape

from helpers.corpus import make_wav, transcript
from helpers.same_batches import MODES, assert_same_batches, keys, run

pytest.importorskip("lhotse", reason="the lhotse extra reads Lhotse manifests")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import compute_lengths  # noqa: E402


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    """Eight cuts with 80-bin Lhotse fbank features: as a manifest without recordings (numpy files),
    as a features-only Shar (numpy, and lilcom as Shar writes by default), and their matrices as a
    Kaldi data dir (feats.scp, text, utt2num_frames) in the same order."""
    import kaldiio
    from lhotse import CutSet, Fbank, FbankConfig, MonoCut, NumpyFilesWriter, Recording, SupervisionSegment

    d = tmp_path_factory.mktemp("lhotse_feats")
    cuts = []
    for i in range(8):
        secs = round(0.5 + 0.13 * i, 2)
        rec = Recording.from_file(make_wav(d / f"u{i}.wav", secs, seed=i), recording_id=f"u{i}")
        cuts.append(MonoCut(f"u{i}", 0.0, secs, 0, recording=rec,
                            supervisions=[SupervisionSegment(f"s{i}", rec.id, 0.0, secs, text=transcript(i))]))
    cuts = CutSet.from_cuts(cuts).compute_and_store_features(
        Fbank(FbankConfig(num_mel_bins=80)), storage_path=str(d / "feats"), storage_type=NumpyFilesWriter)
    no_audio = CutSet.from_cuts(c.drop_recording() for c in cuts)
    no_audio.to_file(d / "feats_cuts.jsonl.gz")
    for fmt in ("numpy", "lilcom"):
        (d / f"shar_{fmt}").mkdir()
        cuts.to_shar(str(d / f"shar_{fmt}"), fields={"features": fmt}, shard_size=5)
        assert compute_lengths.main([str(d / f"shar_{fmt}")]) == 0
    kaldi = d / "kaldi"
    kaldi.mkdir()
    with kaldiio.WriteHelper(f"ark,scp:{kaldi / 'feats.ark'},{kaldi / 'feats.scp'}") as w:
        for c in cuts:
            w(c.id, c.load_features())
    (kaldi / "text").write_text("".join(f"{c.id} {c.supervisions[0].text}\n" for c in cuts))
    (kaldi / "utt2num_frames").write_text("".join(f"{c.id} {c.num_frames}\n" for c in cuts))
    return {"dir": d, "cuts": d / "feats_cuts.jsonl.gz", "shar_numpy": d / "shar_numpy",
            "shar_lilcom": d / "shar_lilcom", "kaldi": kaldi, "keys": [c.id for c in cuts], "cutset": cuts}


@pytest.mark.parametrize("batch_type", MODES)
def test_features_train_like_the_kaldi_list_of_the_same_matrices(feats, tokenizer, batch_type):
    """Features with their SpecAugment, ids, labels and spans: the same batches in every batch mode."""
    want, ds = run(feats["kaldi"], tokenizer, batch_type=batch_type, data_type="kaldi")
    assert sorted(keys(want)) == sorted(feats["keys"]) and ds.stats.skipped == 0
    for kind in ("cuts", "shar_numpy"):
        got, ds = run(feats[kind], tokenizer, batch_type=batch_type)
        assert ds.stats.skipped == 0, kind
        assert_same_batches(got, want)


def test_lilcom_members_decode_as_lhotse_decodes_them(feats, tokenizer):
    """Shar's default (lilcom, lossy): west's matrices are the ones lhotse's own Shar reader loads."""
    from lhotse import CutSet

    from west.data.processors import _load

    source = open_list(str(feats["shar_lilcom"]), DataStats())
    theirs = {c.id: c.load_features() for c in CutSet.from_shar(in_dir=str(feats["shar_lilcom"]))}
    assert len(source) == len(theirs) == 8
    for i in range(len(source)):
        rec = source.record(i)
        assert rec.audio[0].features == "llc" and rec.audio[0].num_frames == theirs[rec.key].shape[0]
        np.testing.assert_array_equal(_load(rec, 16000, 80).feats[0], theirs[rec.key])
    got, ds = run(feats["shar_lilcom"], tokenizer, batch_type="pack")
    assert sorted(keys(got)) == sorted(feats["keys"]) and ds.stats.skipped == 0


def test_bad_feature_members_and_files_are_counted(feats, tokenizer, tmp_path):
    shar = tmp_path / "shar"
    shutil.copytree(feats["shar_numpy"], shar)
    (shar / "features.000001.tar").unlink()                  # cuts 5..7 lose their features
    data = bytearray((shar / "features.000000.tar").read_bytes())
    start = data.index(b"\x93NUMPY")                          # the first member's .npy header, overwritten
    data[start:start + 64] = b"\x00" * 64
    (shar / "features.000000.tar").write_bytes(bytes(data))
    assert compute_lengths.main([str(shar)]) == 0
    got, ds = run(shar, tokenizer, batch_type="pack")
    assert sorted(keys(got)) == sorted(feats["keys"][1:5])
    assert ds.stats.as_dict() == {"missing_file": 3, "corrupt_audio": 1}

    manifest = tmp_path / "cuts.jsonl"                         # a manifest whose feature file is gone
    lines = [json.loads(x) for x in gzip.open(feats["cuts"], "rt")]
    gone = dict(lines[0], features=dict(lines[0]["features"], storage_key="gone.npy"))
    manifest.write_text("".join(json.dumps(x) + "\n" for x in [gone, *lines[1:]]))
    got, ds = run(manifest, tokenizer, batch_type="pack")
    assert sorted(keys(got)) == sorted(feats["keys"][1:]) and ds.stats.as_dict() == {"missing_file": 1}


def test_settings_that_cannot_match_are_refused_up_front(feats, tokenizer, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="frame shift of 10 ms; data.frame_shift_ms is 20"):
        run(feats["cuts"], tokenizer, frame_shift_ms=20.0)
    with pytest.raises(ValueError, match="has precomputed features; data.features whisper"):
        run(feats["cuts"], tokenizer, SpeechShape(encoder_type="whisper", features="whisper"), features="whisper")
    monkeypatch.setitem(sys.modules, "lilcom", None)
    with pytest.raises(ConfigError, match=r"lilcom.*pip install -e '\.\[lhotse\]'"):
        open_list(str(feats["shar_lilcom"]), DataStats())
    monkeypatch.setitem(sys.modules, "h5py", None)             # HDF5 storage: its package named, not a worker's crash
    first = json.loads(next(gzip.open(feats["cuts"], "rt")))
    hdf5 = tmp_path / "hdf5_cuts.jsonl"
    hdf5.write_text(json.dumps(dict(first, features=dict(first["features"], storage_type="numpy_hdf5"))) + "\n")
    with pytest.raises(ConfigError, match=r"HDF5 files; .*h5py.*: pip install h5py"):
        open_list(str(hdf5), DataStats())
