"""tools/prepare_aishell.py: Kaldi lists from a tiny AIShell-1-shaped tree."""
from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import prepare_aishell as pa  # noqa: E402

TRANSCRIPT = """\
BAC009S0003W0001 我们 一个
BAC009S0002W0002 中国 没有 发展
BAC009S0002W0001 他们 自己
BAC009S0004W0001 国家
BAC009S0004W0002 可以 工作
BAC009S0005W0001 这个 问题
BAC009S0099W0001 没有 录音
BAC009S0005W0002
"""
SECONDS = {  # uid -> (split, duration); W0009 has no transcript line
    "BAC009S0002W0001": ("train", 0.5), "BAC009S0002W0002": ("train", 0.25),
    "BAC009S0003W0001": ("train", 1.0), "BAC009S0003W0009": ("train", 0.5),
    "BAC009S0004W0001": ("dev", 0.75), "BAC009S0005W0001": ("test", 0.3),
    "BAC009S0005W0002": ("test", 0.3),
}


def write_wav(path: Path, seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(seconds * 16000)) / 16000
    sf.write(str(path), 0.1 * np.sin(2 * np.pi * 440 * t), 16000, subtype="PCM_16")


def wav_path(root: Path, uid: str, split: str) -> Path:
    return root / "wav" / split / uid[6:11] / f"{uid}.wav"


@pytest.fixture
def aishell(tmp_path) -> Path:
    root = tmp_path / "data_aishell"
    for uid, (split, secs) in SECONDS.items():
        write_wav(wav_path(root, uid, split), secs)
    bad = wav_path(root, "BAC009S0004W0002", "dev")  # has a transcript, audio is garbage
    bad.write_bytes(b"not a wav file at all")
    (root / "transcript").mkdir()
    (root / pa.TRANSCRIPT).write_text(TRANSCRIPT, encoding="utf-8")
    return root


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_reproduces_kaldi_lists(aishell, tmp_path, capsys):
    out = tmp_path / "data"
    reports = pa.main(["--aishell_dir", str(aishell), "--out_dir", str(out)])
    w = lambda uid, split: f"{uid} {wav_path(aishell, uid, split).absolute()}"  # noqa: E731
    assert lines(out / "train" / "wav.scp") == [
        w("BAC009S0002W0001", "train"), w("BAC009S0002W0002", "train"),
        w("BAC009S0003W0001", "train")]
    assert lines(out / "train" / "text") == [
        "BAC009S0002W0001 他们自己", "BAC009S0002W0002 中国没有发展", "BAC009S0003W0001 我们一个"]
    assert lines(out / "train" / "utt2dur") == [
        "BAC009S0002W0001 0.5000", "BAC009S0002W0002 0.2500", "BAC009S0003W0001 1.0000"]
    assert lines(out / "dev" / "text") == ["BAC009S0004W0001 国家"]
    assert lines(out / "test" / "text") == ["BAC009S0005W0001 这个问题"]
    assert not (out / "train" / "data.list").exists()
    by_split = {r.split: r for r in reports}
    assert by_split["train"].no_transcript == ["BAC009S0003W0009"]
    assert by_split["dev"].unreadable == ["BAC009S0004W0002"]
    assert by_split["test"].no_transcript == ["BAC009S0005W0002"]  # id-only transcript line
    log = capsys.readouterr().out
    assert "train: 3 utterances" in log and "1 without transcript" in log
    assert "1 empty lines" in log and "1 transcripts have no wav" in log


def test_jsonl_and_no_durations(aishell, tmp_path):
    out = tmp_path / "data"
    pa.main(["--aishell_dir", str(aishell.parent), "--out_dir", str(out), "--jsonl",
             "--splits", "dev"])  # the folder holding data_aishell/ works too
    recs = [json.loads(x) for x in lines(out / "dev" / "data.list")]
    assert recs == [{"key": "BAC009S0004W0001", "txt": "国家", "duration": 0.75,
                     "wav": str(wav_path(aishell, "BAC009S0004W0001", "dev").absolute())}]
    assert not (out / "train").exists()
    pa.main(["--aishell_dir", str(aishell), "--out_dir", str(out), "--no_durations",
             "--splits", "dev"])
    assert not (out / "dev" / "utt2dur").exists()  # a stale one would not match wav.scp
    # without reading headers the garbage file cannot be detected: it is listed
    assert len(lines(out / "dev" / "wav.scp")) == 2
    with pytest.raises(SystemExit, match="no_durations"):
        pa.main(["--aishell_dir", str(aishell), "--out_dir", str(out), "--jsonl", "--no_durations"])


def test_bad_layouts_name_the_problem(aishell, tmp_path):
    with pytest.raises(SystemExit, match="aishell_transcript_v0.8.txt not found"):
        pa.main(["--aishell_dir", str(aishell / "wav"), "--out_dir", str(tmp_path / "o")])
    dup = aishell / pa.TRANSCRIPT
    dup.write_text(TRANSCRIPT + "BAC009S0002W0001 又 来\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"aishell_transcript_v0.8.txt:9: duplicate"):
        pa.main(["--aishell_dir", str(aishell), "--out_dir", str(tmp_path / "o")])


def test_untar_speaker_archives(tmp_path):
    root = tmp_path / "data_aishell"
    (root / "transcript").mkdir(parents=True)
    (root / pa.TRANSCRIPT).write_text("BAC009S0006W0001 我们\nBAC009S0007W0001 中国\n",
                                      encoding="utf-8")
    (root / "wav").mkdir()
    stage = tmp_path / "stage"
    for uid, split in (("BAC009S0006W0001", "train"), ("BAC009S0007W0001", "dev")):
        speaker = uid[6:11]
        write_wav(wav_path(stage, uid, split), 0.5)
        with tarfile.open(root / "wav" / f"{speaker}.tar.gz", "w:gz") as tar:
            tar.add(stage / "wav" / split / speaker, arcname=f"{split}/{speaker}")
    with pytest.raises(SystemExit, match="--untar"):
        pa.main(["--aishell_dir", str(root), "--out_dir", str(tmp_path / "o"),
                 "--splits", "train", "dev"])
    reports = pa.main(["--aishell_dir", str(root), "--out_dir", str(tmp_path / "o"),
                       "--splits", "train", "dev", "--untar"])
    assert [r.written for r in reports] == [1, 1]
    assert lines(tmp_path / "o" / "dev" / "text") == ["BAC009S0007W0001 中国"]
    assert pa.untar_speakers(root / "wav") == 0  # already extracted: not again
