"""recipes/librispeech/run.sh: help, --data_root on a LibriSpeech-layout folder, and its stages on a
handful of synthesized English utterances (a smoke run: seconds, not a trained model). Stage 7
(averaging) is tools/recipe_stages.sh's, run by tests/test_recipes_aishell.py; it is left out here."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "recipes" / "librispeech" / "run.sh"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_prep_librispeech import GOOD, make_tree  # noqa: E402


def bash(*args, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def test_help_documents_every_stage_and_option():
    r = bash(RUN, "--help")
    assert r.returncode == 0, r.stderr
    text = RUN.read_text(encoding="utf-8")
    names = re.findall(r"^([a-z_]+)=", text[text.index("\nstage=0\n"):text.index("parse_options.sh")], re.M)
    assert {"data_root", "synthetic", "train_sets", "dev_set", "test_sets", "normalizer", "llm_path"} <= set(names)
    assert not [n for n in names if f"--{n}" not in r.stdout]
    assert [int(m) for m in re.findall(r"^ {2}(\d+) +\w", r.stdout, re.M)] == list(range(10))


def test_data_root_lists_a_librispeech_folder(tmp_path):
    make_tree(tmp_path / "src" / "LibriSpeech")
    work = tmp_path / "work"
    r = bash(RUN, "--stop_stage", 1, "--data_root", tmp_path / "src", "--work_dir", work)
    assert r.returncode == 0, r.stderr
    assert f"corpus: the LibriSpeech folder {tmp_path / 'src'} (--data_root)" in r.stdout
    assert "train-clean-100: 3 utterances" in r.stdout and "1 unreadable FLACs" in r.stdout
    assert "19-198-0004" in r.stdout                        # a bad case, named
    assert not (work / "corpus").exists()
    rows = [json.loads(x) for x in (work / "data/dev_clean/data.list").read_text().splitlines()]
    assert [(x["key"], x["txt"]) for x in rows] == [("84-121123-0000", GOOD["84-121123-0000"][2].lower())]
    missing = bash(RUN, "--stop_stage", 1, "--data_root", tmp_path / "src", "--work_dir", work,
                   "--test_sets", "test-other")
    assert missing.returncode != 0 and "has no test-other folder" in missing.stderr


TINY = ["--num_train", 6, "--num_dev", 2, "--num_test", 2, "--num_speakers", 4, "--vocab_size", 20, "--nj", 1,
        "--synth_opts", "--mean_duration 1.5", "--cmvn_utts", 4, "--llm_vocab_size", 300,
        "--llm_pretrain_steps", 3, "--max_steps", 2,
        "--train_opts", "--train.warmup_steps 1 --train.tensorboard false --train.save_every 1",
        "--eval_every", 1, "--eval_decode_utts", 2, "--keep_best", 2,
        "--decode_sets", "test_clean", "--decode_batch_size", 2, "--max_new_tokens", 4,
        # port 9 (discard) on localhost refuses at once: a deterministic "offline" machine
        "--librispeech_url", "http://127.0.0.1:9"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    pytest.importorskip("espeakng_loader", reason="the tts extra (espeakng-loader) synthesizes the corpus")
    pytest.importorskip("whisper_normalizer", reason="the english normalizer needs whisper-normalizer")
    work = tmp_path_factory.mktemp("recipe_en")
    out = ""
    for stages in (["--stop_stage", 6], ["--stage", 8]):
        r = bash(RUN, "--work_dir", work, *TINY, *stages, cwd=work)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        out += r.stdout
    return work, out


def test_stages_0_3_synthesize_and_list_english(tiny_run):
    work, out = tiny_run
    assert "using a synthesized corpus" in out and "corpus: synthesizing English (eSpeak NG)" in out
    assert out.strip().splitlines()[-1].endswith(f"stages 8..9; corpus: {work}/corpus/synth/LibriSpeech)")
    for d, n in (("train_clean_100", 6), ("dev_clean", 2), ("test_clean", 2)):
        rows = [json.loads(x) for x in (work / "data" / d / "data.list").read_text().splitlines()]
        assert len(rows) == n and all(r["wav"].endswith(".flac") and r["txt"].islower() for r in rows)
    assert json.loads((work / "data/train_clean_100/global_cmvn.json").read_text())["frame_num"] > 0


def test_stages_4_5_subword_llm_and_dev_wer(tiny_run):
    work, out = tiny_run
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(work / "exp/tiny_llm"))
    words = {w for line in (work / "data/train_clean_100/text").read_text().splitlines() for w in line.split()[1:]}
    assert max(len(tok.tokenize(" " + w)) for w in words) > 1   # some words are several subword pieces
    run = work / "exp/tiny_cpu"
    evals = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines() if '"eval"' in x]
    assert [e["step"] for e in evals] == [1, 2] and all("cv_wer" in e and "cv_cer" in e for e in evals)
    cfg = (run / "config.yaml").read_text()
    assert "eval_normalizer: english" in cfg and "best_metric: cv_wer" in cfg
    assert "[run.sh] dev WER by step: 1: " in out


def test_stages_6_8_9_decode_wer_table_curves(tiny_run):
    work, out = tiny_run
    run = work / "exp/tiny_cpu"
    for which in ("untrained", "trained"):
        d = run / f"decode_{which}_test_clean"
        rows = [json.loads(x) for x in (d / "result.jsonl").read_text().splitlines()]
        refs = dict(line.split(" ", 1) for line in (work / "data/test_clean/text").read_text().splitlines())
        assert [r["ref"] for r in rows] == [refs[r["key"]] for r in rows]     # raw references kept
        score = json.loads((d / "wer.json").read_text())
        assert score["mode"] == "wer" and score["normalizer"] == "english" and score["utts"] == 2
    table = json.loads((run / "wer_summary.json").read_text())
    assert set(table["test_clean"]) == {"untrained", "trained"}
    assert "[run.sh] WER after the text normalizer english" in out
    assert "| set | untrained WER (step 0) | trained WER (newest checkpoint) |\n" in out
    from west.infer.load import run_normalizer

    assert run_normalizer(str(run)) == "english"                             # west-decode's default for it
    assert run_normalizer(str(run / "untrained_init")) == "english"
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert f"training curves (train and dev loss, dev CER and WER): {run / 'curves.png'}" in out
