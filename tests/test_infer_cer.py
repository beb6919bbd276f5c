"""CER/WER against hand-computed edit distances; file formats; the CLI."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from west.infer.scoring import detect_mode, error_rate, read_transcripts, score_files, tokenize

ROOT = Path(__file__).resolve().parent.parent


def load_tool():
    spec = importlib.util.spec_from_file_location("compute_cer", ROOT / "tools" / "compute_cer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_chinese_cer_hand_computed():
    # 今天天气很好 (6 chars) vs 今天天汽好: 1 substitution (气->汽) + 1 deletion (很) = 2
    # 你好 (2) vs 你好吗: 1 insertion. Total 3 / 8.
    r = error_rate({"a": "今天 天气很好", "b": "你好"}, {"a": "今天天汽好", "b": "你 好 吗"})
    assert r.mode == "cer"
    assert r.per_utt == {"a": (2, 6), "b": (1, 2)}
    assert (r.errors, r.ref_tokens) == (3, 8)
    assert r.rate == pytest.approx(3 / 8)


def test_english_wer_hand_computed():
    # "the cat sat on the mat" vs "the cat sit on mat": sub(sat->sit) + del(the) = 2 / 6
    r = error_rate({"u1": "the cat sat on the mat"}, {"u1": "the  cat sit on mat"})
    assert r.mode == "wer" and (r.errors, r.ref_tokens) == (2, 6)


def test_forced_mode_and_missing_extra():
    r = error_rate({"u1": "ab", "u2": "cd"}, {"u1": "ab", "zz": "x"}, mode="cer")
    assert r.missing == ["u2"] and r.extra == ["zz"]
    assert (r.errors, r.ref_tokens) == (2, 4)  # the missing hyp counts as all deleted
    assert tokenize("a b", "wer") == ["a", "b"] and tokenize("a b", "cer") == ["a", "b"]
    assert detect_mode(["hello"]) == "wer" and detect_mode(["你好"]) == "cer"


def test_kaldi_and_jsonl_files(tmp_path):
    ref = tmp_path / "ref.txt"
    ref.write_text("u1 今天 天气\nu2\n", encoding="utf-8")
    hyp = tmp_path / "hyp.jsonl"
    hyp.write_text(json.dumps({"key": "u1", "text": "今天天气"}, ensure_ascii=False) + "\n"
                   + json.dumps({"key": "u2", "hyp": "啊"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_transcripts(ref) == {"u1": "今天 天气", "u2": ""}
    r = score_files(ref, hyp)
    assert (r.errors, r.ref_tokens) == (1, 4)


def test_bad_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "u1", "text": "a"}\n{"key": "u2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_transcripts(bad)
    dup = tmp_path / "dup.txt"
    dup.write_text("u1 a\nu1 b\n")
    with pytest.raises(ValueError, match=r"dup.txt:2: duplicate key"):
        read_transcripts(dup)


def test_tool_function_and_cli(tmp_path):
    ref, hyp = tmp_path / "ref", tmp_path / "hyp"
    ref.write_text("u1 a b c d\nu2 e f\n")
    hyp.write_text("u1 a x c d\nu2 e f\n")
    tool = load_tool()
    assert tool.compute_cer(str(ref), str(hyp)) == {
        "mode": "wer", "normalizer": "none", "rate": pytest.approx(1 / 6), "errors": 1, "ref_tokens": 6,
        "utts": 2, "missing": 0, "extra": 0}
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "compute_cer.py"), str(ref), str(hyp),
                          "--per_utt"], capture_output=True, text=True, check=True)
    assert "u1\t1/4" in out.stdout and "WER 16.67 %" in out.stdout
