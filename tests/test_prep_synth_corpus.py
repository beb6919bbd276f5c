"""tools/synthesize_corpus.py: AIShell-shaped layout, decodable 16 kHz audio, determinism."""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import prepare_aishell  # noqa: E402
import synthesize_corpus as sc  # noqa: E402

try:
    import espeakng_loader  # noqa: F401
    import jieba  # noqa: F401
    HAVE_TTS = True
except ImportError:
    HAVE_TTS = False
needs_tts = pytest.mark.skipif(
    not HAVE_TTS, reason="espeakng-loader/jieba not installed (pip install -e '.[tts]')")

TINY = ["--num_train", "4", "--num_dev", "2", "--num_test", "2", "--num_speakers", "4",
        "--vocab_size", "50"]
UID = re.compile(r"^BAC009(S\d{4})W\d{4}$")


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != sc.MARKER}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    sc.main(["--out", str(out), "--seed", "3", "--num_workers", "2", *TINY])
    return out / "data_aishell"


def read_transcript(root: Path) -> list[str]:
    return (root / sc.TRANSCRIPT).read_text(encoding="utf-8").splitlines()


@needs_tts
def test_layout_and_transcript_match_aishell(corpus):
    lines = read_transcript(corpus)
    assert lines == sorted(lines) and len(lines) == 8
    vocab = set(sc.load_vocab(50))
    wavs = {p.stem: p for p in corpus.glob("wav/*/*/*.wav")}
    assert set(wavs) == {line.split()[0] for line in lines}
    split_speakers: dict[str, set[str]] = {}
    for line in lines:
        uid, *words = line.split(" ")
        assert UID.match(uid) and words and set(words) <= vocab  # single spaces, known words
        path = wavs[uid]
        speaker, split = path.parent.name, path.parent.parent.name
        assert UID.match(uid).group(1) == speaker and split in sc.SPLITS
        split_speakers.setdefault(split, set()).add(speaker)
    assert {len(v) for v in split_speakers.values()} >= {1}
    a, b, c = (split_speakers[s] for s in sc.SPLITS)
    assert not (a & b or a & c or b & c), "speakers must not be shared between splits"
    meta = json.loads((corpus / sc.MARKER).read_text(encoding="utf-8"))
    assert meta["complete"] and meta["stats"]["utterances"] == {"train": 4, "dev": 2, "test": 2}


@needs_tts
def test_audio_is_decodable_16k_mono_speech(corpus):
    for path in corpus.glob("wav/*/*/*.wav"):
        info = sf.info(str(path))
        assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
        audio, _ = sf.read(str(path), dtype="float32")
        assert 1.0 < len(audio) / 16000 < 16.0
        # speech well above the noise floor somewhere, and never clipped
        assert np.abs(audio).max() > 0.2 and np.abs(audio).max() < 0.999


@needs_tts
def test_deterministic_for_a_seed_whatever_the_workers(corpus, tmp_path):
    sc.main(["--out", str(tmp_path / "again"), "--seed", "3", "--num_workers", "1", *TINY])
    assert tree_digest(tmp_path / "again" / "data_aishell") == tree_digest(corpus)
    sc.main(["--out", str(tmp_path / "other"), "--seed", "4", "--num_workers", "1", *TINY])
    assert read_transcript(tmp_path / "other" / "data_aishell") != read_transcript(corpus)


@needs_tts
def test_check_reuses_a_corpus_made_with_the_same_options(corpus, capsys):
    """What the recipe asks before synthesizing again: only options that change the corpus count."""
    out = str(corpus.parent)
    assert sc.main(["--out", out, "--seed", "3", "--num_workers", "7", "--force", *TINY, "--check"]) == {"same": True}
    assert sc.main(["--out", out, "--seed", "4", *TINY, "--check"]) == {"same": False}
    assert capsys.readouterr().out.split() == ["True", "False"]
    with pytest.raises(OSError):
        sc.main(["--out", out + "_nothing_here", *TINY, "--check"])


@needs_tts
def test_duration_grows_with_text(tmp_path):
    vocab = sc.load_vocab(50)
    spk = sc.Speaker("S0002", "train", "", 175, 50, 50, 0.8, -60.0)
    utts = [sc.Utterance(f"BAC009S0002W{n:04d}", tuple(vocab[:n]), 0.0, 0.0, seed=n)
            for n in (1, 4, 12)]
    with mp.Pool(1) as pool:  # the engine lives in a worker, as in the tool
        durs = dict(pool.apply(sc.render_speaker, ((str(tmp_path), spk, utts),)))
    d1, d4, d12 = (durs[u.uid] for u in utts)
    assert 0.2 < d1 < d4 < d12 and d12 > 2 * d4
    for u in utts:
        assert sf.info(str(tmp_path / "wav" / "train" / "S0002" / f"{u.uid}.wav")).samplerate == 16000


@needs_tts
def test_prepare_aishell_lists_the_synthesized_corpus(corpus, tmp_path):
    reports = prepare_aishell.main(["--aishell_dir", str(corpus), "--out_dir", str(tmp_path)])
    assert [r.written for r in reports] == [4, 2, 2]
    expected = {line.split(" ", 1)[0]: line.split(" ", 1)[1].replace(" ", "")
                for line in read_transcript(corpus)}
    got = {}
    for split in sc.SPLITS:
        for line in (tmp_path / split / "text").read_text(encoding="utf-8").splitlines():
            uid, txt = line.split(" ")
            got[uid] = txt
    assert got == expected


def test_plan_hits_the_duration_model_and_is_seeded(tmp_path):
    vocab = [w + w for w in "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年"]
    counts = {"train": 1500, "dev": 100, "test": 100}
    plan = sc.plan_corpus(counts, 40, vocab, seed=0)
    assert plan == sc.plan_corpus(counts, 40, vocab, seed=0)
    assert plan != sc.plan_corpus(counts, 40, vocab, seed=1)
    est = np.array([sc.speech_seconds(len("".join(u.words)), spk.rate) + u.lead_s + u.trail_s
                    for spk, utts in plan for u in utts])
    assert len(est) == 1700 and abs(est.mean() - 4.5) < 0.25
    assert est.min() > 1.0 and est.max() < 16.0 and est.std() > 1.0  # a realistic spread
    per_split = {s: [u.uid for spk, utts in plan if spk.split == s for u in utts]
                 for s in sc.SPLITS}
    assert {s: len(v) for s, v in per_split.items()} == counts


def test_speakers_per_split():
    assert sc.speakers_per_split({"train": 1500, "dev": 100, "test": 100}, 40) == \
        {"train": 36, "dev": 2, "test": 2}
    assert sc.speakers_per_split({"train": 4, "dev": 2, "test": 0}, 3) == \
        {"train": 2, "dev": 1, "test": 0}
    with pytest.raises(ValueError, match="no train speaker"):
        sc.speakers_per_split({"train": 4, "dev": 2, "test": 2}, 2)


def test_load_vocab_reads_a_jieba_format_dict(tmp_path):
    d = tmp_path / "dict.txt"
    d.write_text("中国 50 ns\n我 99 r\nAT&T 3 nz\n我们 70 r\n一个 70 m\n", encoding="utf-8")
    assert sc.load_vocab(3, str(d)) == ["一个", "我们", "中国"]  # by frequency, ties by word
    d.write_text("中国 50 ns\n我们\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"dict.txt:2"):
        sc.load_vocab(1, str(d))


@needs_tts
def test_default_vocab_is_frequent_multichar_words():
    vocab = sc.load_vocab(300)
    assert len(vocab) == len(set(vocab)) == 300 and vocab[:3] == ["一个", "中国", "我们"]
    assert all(len(w) >= 2 and sc.HAN_WORD.match(w) for w in vocab)


def test_refuses_to_replace_what_it_did_not_write(tmp_path):
    root = tmp_path / "data_aishell"
    root.mkdir()
    (root / "precious.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="--force"):
        sc.prepare_root(root, force=False)
    with pytest.raises(SystemExit, match="not a synthesized corpus"):
        sc.prepare_root(root, force=True)
    assert (root / "precious.txt").exists()
    (root / sc.MARKER).write_text("{}")
    sc.prepare_root(root, force=True)
    assert root.is_dir() and not any(root.iterdir())
