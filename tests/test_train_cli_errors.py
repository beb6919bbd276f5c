"""west-train's command line refuses bad input before any data is read, naming the config key, the
file or the directory (the tiny CPU recipe config, a real list and tiny LLM); nested overrides are typed."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.e2e import ROOT, tiny_llm, train_argv, write_lists


@pytest.fixture(scope="module")
def setup(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("cli_errors")
    return SimpleNamespace(llm=tiny_llm(tmp_path_factory), planned=write_lists(corpus["rows"], d / "lists", 13).jsonl)


def _train_error(argv: list[str], capsys) -> str:
    from west.bin.train import main

    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("extra, key", [
    (["--train.lrr", "1"], "train.lrr"),
    (["--model.encoder.d_modle", "32"], "d_modle"),
    (["--data.batchsize", "3"], "data.batchsize"),
    (["--model.llm.attn_backend", "flash"], "model.llm.attn_backend"),
    (["--model.llm.attn_implementation", "flash_attention_2"], "model.llm.attn_implementation"),
    (["--data.subsampling_rate", "6"], "data.subsampling_rate"),  # geometry lives in the model section
    (["--data.weights", "[1, 2]"], "data.weights"),                # two weights for one list
    (["--batch_size", "4"], "data.batch_size"),  # the tiny config packs: batch_size is not used
])
def test_bad_config_fails_before_data_naming_the_key(setup, tmp_path, capsys, extra, key):
    out = tmp_path / "out"
    err = _train_error(train_argv(setup.llm, setup.planned, out, *extra), capsys)
    assert key in err
    assert not out.exists()  # nothing read, nothing written


def test_missing_llm_path_and_gpu_config_on_cpu(setup, tmp_path, capsys):
    argv = ["--train_data", str(setup.planned), "--output_dir", str(tmp_path / "o")]
    err = _train_error(["--config", str(ROOT / "recipes/aishell/conf/tiny_cpu.yaml"), *argv], capsys)
    assert "model.llm.path: required" in err
    if torch.cuda.is_available():
        pytest.skip("the GPU config is valid on a CUDA machine")
    err = _train_error(["--config", str(ROOT / "recipes/aishell/conf/seed_gpu.yaml"),
                        "--model.llm.path", str(setup.llm), "--model.llm.attn_backend", "flash", *argv], capsys)
    assert "model.llm.attn_backend: flash needs a CUDA device" in err and "--model.llm.attn_backend auto" in err
    for backend, why in (("torch_varlen", "torch's CUDA kernel"), ("flex", "no CPU backward")):
        err = _train_error(["--config", str(ROOT / "recipes/aishell/conf/seed_gpu.yaml"),
                            "--model.llm.path", str(setup.llm), "--model.llm.attn_backend", backend, *argv], capsys)
        assert f"model.llm.attn_backend: {backend}" in err and why in err


def test_missing_or_unwritable_output_dir(setup, tmp_path, capsys):
    argv = train_argv(setup.llm, setup.planned, tmp_path / "x")
    i = argv.index("--output_dir")
    no_out = argv[:i] + argv[i + 2:]
    assert "run.output_dir: required" in _train_error(no_out, capsys)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    argv[i + 1] = str(blocker / "run")
    assert "run.output_dir: cannot write" in _train_error(argv, capsys)
    missing_list = train_argv(setup.llm, tmp_path / "no.list", tmp_path / "y")
    assert "run.train_data: no such file" in _train_error(missing_list, capsys)


def test_nested_model_overrides_are_typed(setup):
    from west.bin.train import parse_train_args

    base = ["--config", str(ROOT / "recipes/aishell/conf/tiny_cpu.yaml"), "--model.llm.path", str(setup.llm)]
    cfg = parse_train_args(base + ["--model.encoder.num_blocks", "3", "--model.projector.dropout", "1e-1",
                                   "--model.lora", "{r: 4}"])
    assert cfg.model.encoder.num_blocks == 3 and cfg.model.projector.dropout == 0.1
    assert cfg.model.lora.r == 4 and cfg.model.llm.path == str(setup.llm)
    assert parse_train_args(base + ["--model.lora", "{r: 4}", "--model.lora", "none"]).model.lora is None
    cfg = parse_train_args(base + ["--model.encoder.subsampling_rate", "6", "--model.projector.stride", "3"])
    shape = cfg.model.speech_shape()
    assert (shape.subsampling_rate, shape.projector_stride) == (6, 3)  # derived from the model, once
