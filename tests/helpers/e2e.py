"""Shared by the end-to-end training tests: a tiny LLM dir and small data lists on disk.

The tiny LLM (byte-level BPE + random 2-layer Qwen2, west.models.tiny_llm) is built
once per pytest session under the session's base temp dir and reused.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from conftest import transcript, write_jsonl

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/helpers/e2e.py)
TINY_CPU = ROOT / "recipes" / "aishell" / "conf" / "tiny_cpu.yaml"


def tiny_encoder(**overrides):
    """tiny_cpu.yaml's Conformer (64-d, 2 blocks; the defaults are the ≈34M AIShell size), ``overrides`` on top."""
    import yaml

    from west.models.config import ConformerConfig

    return ConformerConfig.from_dict({**yaml.safe_load(TINY_CPU.read_text())["model"]["encoder"], **overrides})


def tiny_llm(tmp_path_factory) -> Path:
    out = tmp_path_factory.getbasetemp() / "west_tiny_llm"
    if not (out / "config.json").is_file():
        from west.models.tiny_llm import build_tiny_llm

        texts = [transcript(i) for i in range(200)] + ["Transcribe the speech."]
        build_tiny_llm(texts, out, vocab_size=400, hidden_size=32, intermediate_size=64,
                       num_heads=4, num_kv_heads=2)
    return out


def write_lists(rows: list[dict], out_dir: Path, n: int) -> SimpleNamespace:
    """The first ``n`` corpus rows as lists of every kind a run may train on: ``jsonl`` (one list
    with durations), ``split`` (the same rows in two lists, for ``--train_data a,b``) and
    ``shards`` (a tar shard list with its index)."""
    from west.prep.shards import make_shards

    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = write_jsonl(out_dir / f"data{n}.list", rows[:n])
    half = (n + 1) // 2
    split = [write_jsonl(out_dir / f"part{i}.list", part) for i, part in enumerate((rows[:half], rows[half:n]))]
    shards = Path(make_shards(str(jsonl), str(out_dir / "shards"), 4)[0])
    return SimpleNamespace(jsonl=jsonl, split=",".join(str(p) for p in split), shards=shards)


def train_argv(llm: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """west-train arguments on the tiny CPU recipe config; quiet, no TensorBoard unless asked."""
    return ["--config", str(TINY_CPU), "--model.llm.path", str(llm), "--train_data", str(data),
            "--output_dir", str(out), "--train.progress_bar", "false", "--train.tensorboard", "false",
            "--train.log_every", "1000", "--train.warmup_steps", "2", *extra]


def subprocess_env() -> dict:
    """One intra-op thread (exact replays across processes), the checkout importable (ahead of any
    PYTHONPATH the caller has, which is kept: it may hold the dependencies)."""
    paths = [str(ROOT), str(ROOT / "tests"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(paths))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


PYTHON = sys.executable


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


# Runs west.bin.train with MetricsLogger.log_step patched to SIGKILL the process after step K.
KILL_HOOK = """
import os, sys
from west.train import metrics
K = int(sys.argv[1])
_log_step = metrics.MetricsLogger.log_step
def log_step(self, rec):
    _log_step(self, rec)
    if rec["step"] == K:
        os.kill(os.getpid(), 9)
metrics.MetricsLogger.log_step = log_step
from west.bin.train import main
sys.exit(main(sys.argv[2:]))
"""


def tiny_cpu_model(llm: str, **encoder):
    """tiny_cpu.yaml's model section with the LLM at ``llm`` and ``encoder`` keys on top (its
    dropout is 0.0: every layout and every process computes the same function)."""
    import yaml

    from west.models.config import SpeechLLMConfig

    raw = yaml.safe_load(TINY_CPU.read_text())["model"]
    raw["llm"]["path"] = llm
    raw["encoder"].update(encoder)
    return SpeechLLMConfig.from_dict(raw)


# A one-block Conformer on a tiny LLM: the benchmark tests' run config (llm.path given per test).
BENCH_CONFIG = """\
train: {lr: 0.001, warmup_steps: 2, max_steps: 10, device: cpu, grad_clip: 1.0}
data: {num_workers: 0, dither: 0.0}
model:
  encoder: {d_model: 32, num_heads: 2, ffn_dim: 64, num_blocks: 1, conv_kernel: 3, dropout: 0.0}
  projector: {stride: 2, hidden_dim: 32}
  llm: {attn_implementation: west_varlen, attn_backend: auto, dtype: float32}
  freeze_llm: false
"""


def bench_setup(out_dir: Path, texts) -> tuple[Path, Path]:
    """(tiny LLM dir, run config) for the benchmark tests, written under ``out_dir``."""
    from west.models.tiny_llm import build_tiny_llm

    llm = build_tiny_llm(list(texts) + ["Transcribe the speech."], out_dir / "llm", vocab_size=300,
                         hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    (out_dir / "conf.yaml").write_text(BENCH_CONFIG, encoding="utf-8")
    return llm, out_dir / "conf.yaml"


def eager_and_graphed(tmp_path_factory, corpus: dict, name: str, common: list[str], graphed: list[str]
                      ) -> tuple[Path, dict[str, str]]:
    """west-train twice on the same 13 utterances of ``corpus`` with the tiny LLM: ``common`` flags
    alone (run "eager") and with ``graphed`` too (run "graphs"), one torch thread. Returns the work
    dir (DIR/eager, DIR/graphs) and each run's console output."""
    import contextlib
    import io

    from west.bin.train import main

    from helpers.threads import torch_threads

    d = tmp_path_factory.mktemp(name)
    lists = write_lists(corpus["rows"], d / "lists", 13)
    llm = tiny_llm(tmp_path_factory)
    out = {}
    with torch_threads():
        for run, extra in (("eager", []), ("graphs", graphed)):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                assert main(train_argv(llm, lists.jsonl, d / run, *common, *extra)) == 0
            out[run] = text.getvalue()
    return d, out


def assert_same_final_weights(d: Path, step: int, atol: float) -> None:
    """DIR/eager and DIR/graphs saved the same tensors at ``step``, within ``atol`` (rtol 1e-4)."""
    import torch
    from safetensors.torch import load_file

    final = [load_file(str(d / run / "checkpoints" / f"step_{step:08d}" / "model.safetensors")) for run in ("eager", "graphs")]
    assert final[0].keys() == final[1].keys() and final[0]
    for k in final[0]:
        torch.testing.assert_close(final[1][k], final[0][k], rtol=1e-4, atol=atol, msg=k)


def assert_same_steps(d: Path, steps: int, counter: str) -> None:
    """DIR/graphs logged steps 1..``steps`` with DIR/eager's losses (relative 1e-5) and the same
    ``counter`` (the figures count real rows, not padding)."""
    import pytest

    want, got = (read_jsonl(d / run / "train_log.jsonl") for run in ("eager", "graphs"))
    assert [x["step"] for x in got] == list(range(1, steps + 1))
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b[counter] == a[counter]


def import_tool(name: str):
    """A script of tools/ as a module (tools/ is no package): what its tests call."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
