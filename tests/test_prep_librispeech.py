"""tools/prepare_librispeech.py on a generated miniature LibriSpeech tree with every bad case,
and tools/synthesize_librispeech.py: LibriSpeech's layout, FLAC + .trans.txt, determinism."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import prepare_librispeech as pl  # noqa: E402
import synthesize_librispeech as sl  # noqa: E402

needs_tts = pytest.mark.skipif(importlib.util.find_spec("espeakng_loader") is None,
                               reason="espeakng-loader not installed (pip install -e '.[tts]')")

GOOD = {  # uid -> (subset, seconds, transcript as LibriSpeech writes it)
    "19-198-0000": ("train-clean-100", 0.5, "NORTHANGER ABBEY"),
    "19-198-0001": ("train-clean-100", 0.3, "THIS LITTLE WORK WAS FINISHED"),
    "26-496-0000": ("train-clean-100", 0.4, "CHAPTER ONE"),
    "84-121123-0000": ("dev-clean", 0.6, "GO DO YOU HEAR"),
    "1089-134686-0000": ("test-clean", 0.35, "HE HOPED THERE WOULD BE STEW"),
}


def flac(path: Path, seconds: float, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), 0.1 * np.random.default_rng(seed).standard_normal(int(seconds * 16000)), 16000,
             format="FLAC", subtype="PCM_16")


def chapter_dir(root: Path, subset: str, uid: str) -> Path:
    spk, chap, _ = uid.split("-")
    return root / subset / spk / chap


def make_tree(root: Path) -> None:
    """GOOD, plus one of each bad case in train-clean-100."""
    lines: dict[Path, list[str]] = {}
    for i, (uid, (subset, secs, text)) in enumerate(GOOD.items()):
        d = chapter_dir(root, subset, uid)
        flac(d / f"{uid}.flac", secs, i)
        lines.setdefault(d / f"{d.parent.name}-{d.name}.trans.txt", []).append(f"{uid} {text}")
    train = root / "train-clean-100"
    t198 = train / "19" / "198" / "19-198.trans.txt"
    lines[t198] += ["19-198-0002 A LINE WITHOUT AUDIO", "19-198-0003", "19-198-0000 THE SAME ID AGAIN"]
    flac(train / "19" / "198" / "19-198-0003.flac", 0.2)          # its line is empty
    flac(train / "19" / "198" / "19-198-0004.flac", 0.2)          # no line at all
    flac(train / "19" / "227" / "19-227-0000.flac", 0.2)          # a chapter without .trans.txt
    flac(train / "19" / "227" / "19-227-0001.flac", 0.2)
    bad = train / "26" / "496" / "26-496-0001.flac"               # not audio
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(b"fLaC but not really")
    lines[train / "26" / "496" / "26-496.trans.txt"].append("26-496-0001 BROKEN FILE")
    for path, ls in lines.items():
        path.write_text("".join(line + "\n" for line in ls), encoding="utf-8")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    base = tmp_path_factory.mktemp("ls")
    make_tree(base / "LibriSpeech")
    out = base / "data"
    reports = pl.main(["--data_root", str(base), "--out_dir", str(out),    # the folder holding LibriSpeech/
                       "--subsets", "train-clean-100", "dev-clean", "test-clean"])
    return base, out, {r.subset: r for r in reports}


def test_good_utterances_become_lists(prepared):
    base, out, reports = prepared
    root = base / "LibriSpeech"
    for subset in ("train-clean-100", "dev-clean", "test-clean"):
        uids = sorted(u for u, (s, _, _) in GOOD.items() if s == subset)
        d = out / subset.replace("-", "_")
        wavs = {u: (chapter_dir(root, subset, u) / f"{u}.flac").absolute() for u in uids}
        assert (d / "wav.scp").read_text() == "".join(f"{u} {wavs[u]}\n" for u in uids)
        assert (d / "text").read_text() == "".join(f"{u} {GOOD[u][2].lower()}\n" for u in uids)
        rows = [json.loads(x) for x in (d / "data.list").read_text().splitlines()]
        assert [(r["key"], r["wav"], r["txt"]) for r in rows] == [(u, str(wavs[u]), GOOD[u][2].lower()) for u in uids]
        assert [r["duration"] for r in rows] == pytest.approx([GOOD[u][1] for u in uids], abs=1e-3)
        assert reports[subset].written == len(uids)
    assert (reports["train-clean-100"].speakers, reports["train-clean-100"].chapters) == (2, 3)


def test_every_bad_case_is_counted_and_named(prepared, capsys):
    _, out, reports = prepared
    p = reports["train-clean-100"].problems
    assert p["no_trans_file"] == [str(prepared[0] / "LibriSpeech" / "train-clean-100" / "19" / "227")]
    assert p["no_transcript"] == ["19-198-0004", "19-227-0000", "19-227-0001"]
    assert p["no_audio"] == ["19-198-0002"]
    assert [x.split()[0] for x in p["empty_transcript"]] == ["19-198-0003"]
    assert p["empty_transcript"][0].endswith("19-198.trans.txt:4)")
    assert [x.split()[0] for x in p["duplicate"]] == ["19-198-0000"]
    assert p["unreadable"] == ["26-496-0001"]
    assert not any(reports["dev-clean"].problems.values())
    skipped = (out / "train_clean_100" / "skipped.txt").read_text().splitlines()
    assert len(skipped) == 8 and "unreadable\t26-496-0001" in skipped and "no_audio\t19-198-0002" in skipped
    line = reports["train-clean-100"].line()
    assert line.startswith("train-clean-100: 3 utterances") and "1 chapters without .trans.txt" in line
    assert "3 FLACs without a transcript line" in line and "1 unreadable FLACs" in line


def test_case_keep_and_layout_errors(tmp_path, prepared):
    base, _, _ = prepared
    pl.main(["--data_root", str(base / "LibriSpeech"), "--out_dir", str(tmp_path / "o"),
             "--subsets", "dev-clean", "--case", "keep"])
    assert (tmp_path / "o" / "dev_clean" / "text").read_text() == "84-121123-0000 GO DO YOU HEAR\n"
    with pytest.raises(SystemExit, match=r"has no test-other folder \(found: train-clean-100, dev-clean, test-clean\)"):
        pl.main(["--data_root", str(base), "--out_dir", str(tmp_path / "o"), "--subsets", "test-other"])
    with pytest.raises(SystemExit, match="does not exist"):
        pl.main(["--data_root", str(tmp_path / "nowhere"), "--out_dir", str(tmp_path / "o")])


# ----------------------------------------------------------------------------- the synthesized corpus
TINY = ["--num_train", "4", "--num_dev", "2", "--num_test", "2", "--num_speakers", "4", "--vocab_size", "40",
        "--mean_duration", "2"]


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != sl.MARKER}


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    if importlib.util.find_spec("espeakng_loader") is None:
        pytest.skip("espeakng-loader not installed (pip install -e '.[tts]')")
    out = tmp_path_factory.mktemp("synth_en")
    sl.main(["--out", str(out), "--seed", "5", "--num_workers", "2", *TINY])
    return out / "LibriSpeech"


@needs_tts
def test_synthesized_corpus_has_librispeech_layout(synthesized, tmp_path):
    flacs = sorted(synthesized.glob("*/*/*/*.flac"))
    assert len(flacs) == 8
    for f in flacs:
        subset, spk, chap = f.parts[-4:-1]
        assert subset in sl.SUBSETS.values() and f.stem.startswith(f"{spk}-{chap}-")
        info = sf.info(str(f))
        assert (info.format, info.samplerate, info.channels) == ("FLAC", 16000, 1) and 0.5 < info.duration < 8
        trans = f.parent / f"{spk}-{chap}.trans.txt"
        words = dict(line.split(" ", 1) for line in trans.read_text().splitlines())[f.stem].split()
        assert words and all(w.isupper() and w.lower() in sl.WORDS[:40] for w in words)
    assert (synthesized / "SPEAKERS.TXT").read_text().startswith(";ID")
    reports = pl.main(["--data_root", str(synthesized.parent), "--out_dir", str(tmp_path)])
    assert [r.written for r in reports] == [4, 2, 2] and not any(v for r in reports for v in r.problems.values())


@needs_tts
def test_synthesis_is_deterministic_and_reusable(synthesized, tmp_path, capsys):
    sl.main(["--out", str(tmp_path / "again"), "--seed", "5", "--num_workers", "1", *TINY])
    assert digest(tmp_path / "again" / "LibriSpeech") == digest(synthesized)
    out = str(synthesized.parent)
    assert sl.main(["--out", out, "--seed", "5", "--num_workers", "3", *TINY, "--check"]) == {"same": True}
    assert sl.main(["--out", out, "--seed", "6", *TINY, "--check"]) == {"same": False}


def test_plan_is_seeded_and_splits_speakers_by_chapter():
    counts = {"train": 30, "dev": 4, "test": 4}
    plan = sl.plan_corpus(counts, 10, sl.WORDS, seed=0, chapters_per_speaker=2)
    assert plan == sl.plan_corpus(counts, 10, sl.WORDS, seed=0, chapters_per_speaker=2)
    assert plan != sl.plan_corpus(counts, 10, sl.WORDS, seed=1, chapters_per_speaker=2)
    per_split = {s: sum(len(u) for spk, chs in plan if spk.split == s for _, u in chs) for s in sl.SPLITS}
    assert per_split == counts
    assert {spk.voice for spk, _ in plan} <= set(sl.VOICES) and len({spk.voice for spk, _ in plan}) > 2
    chapters = [c for _, chs in plan for c, _ in chs]
    assert len(chapters) == len(set(chapters)) == 20
    assert len(set(sl.WORDS)) == len(sl.WORDS) and all(w.isalpha() and w.islower() for w in sl.WORDS)
