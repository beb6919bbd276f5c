"""recipes/aishell/run.sh and tools/parse_options.sh: help, option parsing, data preparation
from the AIShell layout, and every stage (0-10) on a tiny synthesized corpus."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "recipes" / "aishell" / "run.sh"
PARSE = REPO / "tools" / "parse_options.sh"


def bash(*args, env=None, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, env=e, cwd=cwd,
                          timeout=timeout)


def declared_options() -> list[str]:
    """The option variables run.sh declares before sourcing parse_options.sh."""
    text = RUN.read_text(encoding="utf-8")
    block = text[text.index("\nstage=0\n"):text.index("parse_options.sh")]
    return re.findall(r"^([a-z_]+)=", block, re.M)


# ----------------------------------------------------------------------------- run.sh --help
def test_help_documents_every_stage_and_option():
    r = bash(RUN, "--help")
    assert r.returncode == 0, r.stderr
    names = declared_options()
    assert {"stage", "stop_stage", "aishell_dir", "synthetic", "shards", "llm_path", "batch_type",
            "pack_tokens", "bench_utts", "eval_every", "eval_decode_utts", "keep_best", "best_metric",
            "average_num", "average_mode"} <= set(names)
    missing = [n for n in names if f"--{n}" not in r.stdout]
    assert not missing, f"options without help: {missing}"
    stages = [int(m) for m in re.findall(r"^ {2}(\d+) +\w", r.stdout, re.M)]
    assert stages == list(range(11))
    assert not r.stdout.startswith("#")   # the comment markers are stripped


# ----------------------------------------------------------------------------- parse_options.sh
@pytest.fixture
def script(tmp_path) -> Path:
    s = tmp_path / "demo.sh"
    s.write_text(f"""#!/usr/bin/env bash
# Demo: header line one
#   indented line two
a=1
b_c=x
flag=false
. {PARSE} || exit 1
echo "a=$a b_c=$b_c flag=$flag rest=$*"
""", encoding="utf-8")
    return s


@pytest.mark.parametrize("argv,out", [
    ([], "a=1 b_c=x flag=false rest="),
    (["--a", "5", "--b-c=y y", "--flag", "true", "p1", "p2"], "a=5 b_c=y y flag=true rest=p1 p2"),
    (["--b_c", "", "--", "--a", "3"], "a=1 b_c= flag=false rest=--a 3"),
])
def test_parse_options_sets_variables(script, argv, out):
    r = bash(script, *argv)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == out


@pytest.mark.parametrize("argv,err", [
    (["--nope", "1"], "unknown option --nope"),
    (["--flag", "yes"], "--flag takes true or false"),
    (["--a"], "option --a needs a value"),
    (["--9x", "1"], "unknown option --9x"),
])
def test_parse_options_rejects_bad_options(script, argv, err):
    r = bash(script, *argv)
    assert r.returncode == 1 and r.stdout == ""
    assert err in r.stderr


def test_parse_options_help_prints_header(script):
    r = bash(script, "-h", "--a", "2")
    assert r.returncode == 0
    assert r.stdout == "Demo: header line one\n  indented line two\n"


# ----------------------------------------------------------------------------- stage 0-1 on AIShell layout
AISHELL = {  # uid -> (split, seconds, transcript with AIShell's word spaces)
    "BAC009S0002W0122": ("train", 0.6, "而 对 楼市 成交"),
    "BAC009S0002W0123": ("train", 0.4, "也 成为 地方"),
    "BAC009S0003W0121": ("train", 0.5, "一 是 房地产"),
    "BAC009S0724W0121": ("dev", 0.3, "广州 市 政府"),
    "BAC009S0764W0121": ("test", 0.45, "甚至 出现 交易"),
}


def make_aishell(root: Path) -> None:
    for uid, (split, secs, _) in AISHELL.items():
        wav = root / "wav" / split / uid[6:11] / f"{uid}.wav"
        wav.parent.mkdir(parents=True, exist_ok=True)
        sf.write(str(wav), 0.1 * np.random.default_rng(len(uid)).standard_normal(int(secs * 16000)), 16000,
                 subtype="PCM_16")
    (root / "transcript").mkdir(parents=True)
    (root / "transcript" / "aishell_transcript_v0.8.txt").write_text(
        "".join(f"{u} {t}\n" for u, (_, _, t) in sorted(AISHELL.items())), encoding="utf-8")


def test_prepare_lists_from_aishell_layout(tmp_path):
    corpus = tmp_path / "src" / "data_aishell"
    make_aishell(corpus)
    work = tmp_path / "work"
    r = bash(RUN, "--stage", 0, "--stop_stage", 1, "--aishell_dir", corpus.parent, "--work_dir", work)
    assert r.returncode == 0, r.stderr
    assert "using the corpus in" in r.stdout
    assert not (work / "corpus").exists()   # nothing downloaded or synthesized
    for split in ("train", "dev", "test"):
        uids = sorted(u for u, (s, _, _) in AISHELL.items() if s == split)
        wavs = {u: corpus.resolve() / "wav" / split / u[6:11] / f"{u}.wav" for u in uids}
        d = work / "data" / split
        assert (d / "wav.scp").read_text(encoding="utf-8") == "".join(f"{u} {wavs[u]}\n" for u in uids)
        assert (d / "text").read_text(encoding="utf-8") == "".join(
            f"{u} {AISHELL[u][2].replace(' ', '')}\n" for u in uids)
        rows = [json.loads(line) for line in (d / "data.list").read_text(encoding="utf-8").splitlines()]
        assert [(x["key"], x["wav"], x["txt"]) for x in rows] == [
            (u, str(wavs[u]), AISHELL[u][2].replace(" ", "")) for u in uids]
        assert [x["duration"] for x in rows] == pytest.approx([AISHELL[u][1] for u in uids], abs=1e-3)


def test_missing_aishell_dir_fails(tmp_path):
    r = bash(RUN, "--stop_stage", 0, "--aishell_dir", tmp_path / "nowhere", "--work_dir", tmp_path / "w")
    assert r.returncode != 0 and "does not exist" in r.stderr


# ----------------------------------------------------------------------------- every stage, tiny
TINY = ["--num_train", 8, "--num_dev", 2, "--num_test", 2, "--num_speakers", 6, "--nj", 1,
        "--synth_opts", "--mean_duration 1.2", "--cmvn_utts", 4, "--llm_vocab_size", 300, "--llm_pretrain_steps", 5,
        "--max_steps", 2, "--train_opts", "--train.warmup_steps 1 --train.tensorboard false",
        "--eval_every", 1, "--eval_decode_utts", 2, "--keep_best", 2, "--average_num", 2,
        "--decode_sets", "test", "--decode_batch_size", 2, "--max_new_tokens", 6,
        "--bench_utts", 6, "--bench_repeats", 1, "--bench_threads", 1,
        "--bench_opts", "--batch_size 2 --max_tokens_in_batch 256 --pack_tokens 512 --profile never",
        # port 9 (discard) on localhost refuses at once: a deterministic "offline" machine
        "--aishell_url", "http://127.0.0.1:9/data_aishell.tgz"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    pytest.importorskip("espeakng_loader", reason="the tts extra (espeakng-loader) synthesizes the corpus")
    pytest.importorskip("jieba", reason="the tts extra (jieba) gives the corpus its words")
    work = tmp_path_factory.mktemp("recipe")
    r = bash(RUN, "--work_dir", work, *TINY, cwd=work)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return work, r.stdout


def test_stage0_synthesizes_when_offline(tiny_run):
    work, out = tiny_run
    assert "offline" in out and "using a synthesized corpus" in out
    info = json.loads((work / "corpus/synth/data_aishell/synthesis.json").read_text(encoding="utf-8"))
    assert info["complete"] and info["args"]["num_train"] == 8 and info["args"]["mean_duration"] == 1.2


def test_stage1_lists(tiny_run):
    work, _ = tiny_run
    for split, n in (("train", 8), ("dev", 2), ("test", 2)):
        rows = [json.loads(x) for x in (work / "data" / split / "data.list").read_text(encoding="utf-8").splitlines()]
        assert len(rows) == n and all(r["duration"] > 0 and r["txt"] for r in rows)
        assert len((work / "data" / split / "wav.scp").read_text().splitlines()) == n
    assert json.loads((work / "data/train/global_cmvn.json").read_text())


def test_stage4_5_llm_and_checkpoint(tiny_run):
    work, out = tiny_run
    assert (work / "exp/tiny_llm/config.json").is_file() and (work / "exp/tiny_llm/tokenizer.json").is_file()
    assert "tiny LLM pretraining on compact streams: answer loss" in out  # conf/tiny_cpu.yaml: ctc_compact
    run = work / "exp/tiny_cpu"
    lines = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in lines if "event" not in s] == [1, 2]
    evals = [s for s in lines if s.get("event") == "eval"]
    assert [e["step"] for e in evals] == [1, 2]                # --cv_data data/dev, --eval_every 1
    assert all(e["cv_utts"] == 2 and e["cv_decoded_utts"] == 2 and "cv_cer" in e for e in evals)
    for step in (1, 2):
        meta = json.loads((run / f"checkpoints/step_{step:08d}/meta.json").read_text())
        assert set(meta["eval"]) >= {"cv_loss", "cv_cer"}
    assert "mean loss of the first" in out and "[run.sh] dev loss by step: 1: " in out


def test_stage6_8_decode_average_and_cer(tiny_run):
    work, out = tiny_run
    run = work / "exp/tiny_cpu"
    assert (run / "untrained_init/west_model.json").is_file()
    for which in ("trained", "untrained", "averaged"):
        rows = (run / f"decode_{which}_test/result.jsonl").read_text(encoding="utf-8").splitlines()
        assert len(rows) == 2 and {"key", "hyp"} <= set(json.loads(rows[0]))
    cer = json.loads((run / "cer_summary.json").read_text())
    assert set(cer) == {"test"} and set(cer["test"]) == {"trained", "untrained", "averaged"}
    assert all(cer["test"][w]["utts"] == 2 for w in ("trained", "untrained", "averaged"))
    assert "| set | untrained CER (step 0) | trained CER (newest checkpoint) | averaged CER (2 best by cv_cer: steps" in out


def test_stage7_averages_the_best_checkpoints(tiny_run):
    work, out = tiny_run
    run = work / "exp/tiny_cpu"
    avg = run / "avg_2"
    assert (avg / "west_model.json").is_file() and (avg / "config.yaml").read_text() == (run / "config.yaml").read_text()
    rec = json.loads((avg / "averaged.json").read_text())
    assert rec["mode"] == "best" and rec["metric"] == "cv_cer" and sorted(rec["steps"]) == [1, 2]
    cers = [c["eval"]["cv_cer"] for c in rec["checkpoints"]]
    assert cers == sorted(cers)                                   # best first
    assert re.search(r"averaged 2 checkpoint\(s\) \(best by cv_cer\): step \d \(cv_loss [\d.]+, cv_cer [\d.]+%\); "
                     r"step \d .* -> " + re.escape(str(avg)), out)


def test_stage9_curves_path_printed_at_the_end(tiny_run):
    work, out = tiny_run
    png = work / "exp/tiny_cpu/curves.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    tail = out.strip().splitlines()[-2:]
    assert tail[0].endswith(f"training curves (train and dev loss, dev CER): {png}") and "done (stages 0..10)" in tail[1]


@pytest.mark.parametrize("name", ["benchmark", "benchmark_llm_heavy"])
def test_stage10_benchmark(tiny_run, name):
    """Both regimes: the tiny model (encoder-heavy) and the LLM-heavy configuration."""
    work, out = tiny_run
    bench = work / "exp" / name
    res = json.loads((bench / "benchmark.json").read_text(encoding="utf-8"))
    assert list(res["modes"]) == ["static", "dynamic", "pack", "pack_encoder_padded"]
    assert res["num_utts"] == 6 and res["env"]["threads"] == 1
    assert (bench / "benchmark.png").read_bytes()[:4] == b"\x89PNG"
    assert "| method | configuration | CPU util %" in out and "| sequence pack |" in out
    assert (bench / "benchmark.md").read_text(encoding="utf-8").splitlines()[0] in out
    assert res["config"].endswith("bench_llm_heavy.yaml") == (name == "benchmark_llm_heavy")


def test_rerun_reuses_corpus(tiny_run):
    work, _ = tiny_run
    r = bash(RUN, "--work_dir", work, *TINY, "--stop_stage", 0)
    assert r.returncode == 0 and "already in" in r.stdout
