"""The scoring normalizers of west.infer.scoring on known pairs, WER/CER unchanged under
``none``, and the places that take one by name: tools/compute_cer.py, the dev evaluator's
config key, west-decode."""
from __future__ import annotations

import builtins
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from west.infer import scoring
from west.infer.scoring import NORMALIZERS, error_rate, get_normalizer, score_files

ROOT = Path(__file__).resolve().parent.parent
needs_whisper_normalizer = pytest.mark.skipif(
    importlib.util.find_spec("whisper_normalizer") is None,
    reason="whisper-normalizer not installed (pip install -e '.[english]')")
needs_opencc = pytest.mark.skipif(importlib.util.find_spec("opencc") is None,
                                  reason="OpenCC not installed (pip install -e '.[mandarin]')")


@needs_whisper_normalizer
@pytest.mark.parametrize("ref,hyp", [
    ("Mr. Smith has 2 cats!", "mister smith has two cats"),
    ("It's twenty-five percent of the colour.", "it is 25% of the color"),
    ("HELLO, WORLD", "hello world"),
    ("uh, the [noise] house (laughs) hmm", "the house"),
    ("We won't go.", "we will not go"),
])
def test_english_makes_known_pairs_equal(ref, hyp):
    english = get_normalizer("english")
    assert english(ref) == english(hyp)
    r = error_rate({"u": ref}, {"u": hyp}, normalizer="english")
    assert r.errors == 0 and r.mode == "wer" and r.normalizer == "english"
    assert error_rate({"u": ref}, {"u": hyp}).errors > 0   # raw strings differ


@needs_whisper_normalizer
def test_english_keeps_real_errors():
    # one substitution (cat -> hat) survives normalization; case and punctuation do not count
    r = error_rate({"u": "The CAT sat."}, {"u": "the hat sat"}, normalizer="english")
    assert (r.errors, r.ref_tokens) == (1, 3)


def test_mandarin_full_width_and_punctuation():
    m = get_normalizer("mandarin")
    assert m("ＡＢＣ１２３，你好！") == "ABC123你好"
    assert m("“今天”天气《很好》。　是吗？") == "今天天气很好 是吗"
    assert m("a-b, c.d") == "ab cd"
    r = error_rate({"u": "今天，天气很好。"}, {"u": "今天天气很好"}, normalizer="mandarin")
    assert r.mode == "cer" and (r.errors, r.ref_tokens) == (0, 6)
    assert error_rate({"u": "今天，天气很好。"}, {"u": "今天天气很好"}).errors == 2   # ，and 。 count raw


@needs_opencc
def test_mandarin_t2s_converts_traditional():
    assert get_normalizer("mandarin_t2s")("說話，測試！") == "说话测试"
    assert get_normalizer("mandarin")("說話") == "說話"


def test_none_leaves_scores_unchanged():
    refs = {"a": "今天 天气很好", "b": "你好", "c": "the cat sat on the mat"}
    hyps = {"a": "今天天汽好", "b": "你 好 吗", "c": "the  cat sit on mat"}
    for mode in ("auto", "cer", "wer"):
        plain, named = error_rate(refs, hyps, mode), error_rate(refs, hyps, mode, normalizer="none")
        assert (plain.errors, plain.ref_tokens, plain.per_utt) == (named.errors, named.ref_tokens, named.per_utt)
    assert (error_rate(refs, hyps, "cer").errors, error_rate(refs, hyps, "cer").ref_tokens) == (7, 25)
    assert error_rate({"c": refs["c"]}, {"c": hyps["c"]}).summary().startswith("WER 33.33 % [ 2 / 6, 1 utts")


def test_unknown_and_unavailable_normalizers_fail_clearly(monkeypatch):
    with pytest.raises(ValueError, match="unknown normalizer 'klingon': choose one of none, english, mandarin"):
        get_normalizer("klingon")
    real_import = builtins.__import__

    def no_libraries(name, *args, **kwargs):
        if name.startswith(("whisper_normalizer", "opencc")):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_libraries)
    monkeypatch.setattr(scoring, "_english", scoring._english.__wrapped__)
    monkeypatch.setattr(scoring, "_t2s", scoring._t2s.__wrapped__)
    with pytest.raises(ValueError, match=r"'english' needs the whisper-normalizer package: pip install -e '\.\[english\]'"):
        error_rate({"u": "a"}, {"u": "a"}, normalizer="english")
    with pytest.raises(ValueError, match=r"'mandarin_t2s' needs OpenCC: pip install -e '\.\[mandarin\]'"):
        get_normalizer("mandarin_t2s")
    assert get_normalizer("mandarin")("你好。") == "你好"   # needs no library


@needs_whisper_normalizer
def test_compute_cer_names_the_normalizer_and_reads_raw_files(tmp_path):
    ref, hyp = tmp_path / "ref", tmp_path / "hyp.jsonl"
    ref.write_text("u1 MR. SMITH HAS 2 CATS\nu2 the dog\n")
    rows = [{"key": "u1", "hyp": "Mister Smith has two cats.", "ref": "MR. SMITH HAS 2 CATS"},
            {"key": "u2", "hyp": "a dog", "ref": "the dog"}]
    hyp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = hyp.read_text()
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "compute_cer.py"), str(ref), str(hyp),
                          "--normalizer", "english", "--json", str(tmp_path / "wer.json")],
                         capture_output=True, text=True, check=True)
    assert "WER 14.29 % [ 1 / 7, 2 utts" in out.stdout and out.stdout.rstrip().endswith("normalizer english")
    assert json.loads((tmp_path / "wer.json").read_text()) == {
        "mode": "wer", "normalizer": "english", "rate": pytest.approx(1 / 7), "errors": 1, "ref_tokens": 7,
        "utts": 2, "missing": 0, "extra": 0}
    assert hyp.read_text() == before   # the result file keeps the raw texts
    raw = score_files(ref, hyp)
    assert raw.normalizer == "none" and raw.errors > 1
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "compute_cer.py"), str(ref), str(hyp),
                          "--normalizer", "klingon"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'klingon'" in bad.stderr


def test_train_config_takes_a_normalizer_by_name():
    from west.schema import ConfigError
    from west.train.config import TrainConfig

    assert TrainConfig.from_dict({"eval_normalizer": "mandarin"}).eval_normalizer == "mandarin"
    assert TrainConfig.from_dict({}).eval_normalizer == "none"
    with pytest.raises(ConfigError, match=r"train.eval_normalizer: must be one of \('none', 'english'"):
        TrainConfig.from_dict({"eval_normalizer": "klingon"})
    with pytest.raises(ConfigError, match="train.best_metric: cv_cer and cv_wer need dev decoding"):
        TrainConfig.from_dict({"best_metric": "cv_wer"})
    assert set(NORMALIZERS) == {"none", "english", "mandarin", "mandarin_t2s"}
