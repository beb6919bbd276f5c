"""Config: YAML + typed overrides + CLI flags, errors naming the key, saved config.yaml."""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import yaml

from west.train import config as C
from west.train.cli import check_paths, parse_cli, prepare_output_dir, save_config
from west.train.config import ConfigError, build_config


@pytest.fixture(autouse=True)
def pristine_registry(monkeypatch):
    """Other test modules run the real CLI, which registers the data/model schemas
    process-wide; these tests check the registry itself, so start each from scratch."""
    base = {"run": C.RunConfig, "train": C.TrainConfig, "data": None, "model": None, "decode": None}
    monkeypatch.setattr(C, "SECTIONS", base)
    monkeypatch.setattr(C, "VALIDATORS", [])


@pytest.fixture
def conf(tmp_path):
    p = tmp_path / "conf.yaml"
    p.write_text(yaml.safe_dump({
        "train": {"lr": "1e-4", "betas": [0.9, 0.95], "precision": "bf16"},  # "1e-4" is a str in YAML 1.1
        "data": {"batch_type": "pack", "pack_tokens": 4096, "num_workers": 2},
        "model": {"llm": "tiny", "freeze_llm": True},
    }))
    return str(p)


def test_yaml_flags_and_overrides_are_typed(conf, tmp_path):
    cfg = parse_cli(["--config", conf, "--output_dir", str(tmp_path / "exp"), "--max_steps", "20",
                     "--seed", "7", "--train.lr", "3e-4", "--train.betas", "0.8,0.9",
                     "--train.grad_checkpointing", "true", "--model.freeze_llm=false",
                     "--data.num_workers", "4", "--model.new_key", "[1, 2]", "--audit"])
    t = cfg.train
    assert t.lr == 3e-4 and isinstance(t.lr, float)
    assert t.betas == [0.8, 0.9] and t.precision == "bf16" and t.grad_checkpointing is True
    assert t.max_steps == 20 and t.seed == 7
    assert cfg.model == {"llm": "tiny", "freeze_llm": False, "new_key": [1, 2]}
    assert cfg.data["num_workers"] == 4 and cfg.data["pack_tokens"] == 4096
    assert cfg.run.audit is True and cfg.run.output_dir.endswith("exp")
    assert cfg.get("data.batch_type") == "pack"


def test_yaml_float_written_without_dot_is_read():
    cfg = build_config(None, [("train.lr", "5e-5")])
    assert cfg.train.lr == 5e-5


@pytest.mark.parametrize("argv, key", [
    (["--train.lrr", "1"], "train.lrr"),
    (["--train.lr", "fast"], "train.lr"),
    (["--train.accum_steps", "1.5"], "train.accum_steps"),
    (["--train.grad_checkpointing", "maybe"], "train.grad_checkpointing"),
    (["--optim.lr", "1"], "optim"),
    (["--lr", "1"], "--lr"),
    (["--train.precision", "fp16"], "train.precision"),
    (["--train.max_steps", "0", "--train.max_epochs", "0"], "train.max_steps"),
    (["--train.accum_steps", "0"], "train.accum_steps"),
    (["--train.betas", "0.9"], "train.betas"),
    (["--batch_type", "pack", "--batch_size", "16"], "data.batch_size"),
    (["--batch_type", "static", "--pack_tokens", "8192"], "data.pack_tokens"),
    (["--batch_type", "dynamic", "--max_tokens_in_batch", "0"], "data.max_tokens_in_batch"),
    (["--resume", "/no/such/ckpt"], "run.resume"),
    (["--data.batch_size", "many"], "data.batch_size"),
])
def test_errors_name_the_key(argv, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_cli(argv)


def test_unknown_section_and_key_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trian:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="unknown section 'trian'"):
        build_config(str(p))
    p.write_text("train:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match="train.learning_rate"):
        build_config(str(p))
    with pytest.raises(ConfigError, match="no such file"):
        build_config(str(tmp_path / "missing.yaml"))


def test_batch_type_flags_fit_their_mode():
    cfg = parse_cli(["--batch_type", "dynamic", "--max_tokens_in_batch", "2048"])
    assert cfg.data["max_tokens_in_batch"] == 2048
    cfg = parse_cli(["--batch_type", "static", "--batch_size", "8"])
    assert cfg.data["batch_size"] == 8


def test_registered_schema_and_validator():
    @dataclass
    class DataConf:
        batch_type: str = "static"
        batch_size: int = 32
        max_tokens_in_batch: int = 4096
        pack_tokens: int = 8192
        shuffle_buffer: int = 1500

    def no_flash_on_cpu(cfg):
        if cfg.model.get("attn") == "flash_attn":
            raise ConfigError("model.attn: flash_attn needs CUDA")

    saved = dict(C.SECTIONS), list(C.VALIDATORS)
    try:
        C.register_section("data", DataConf)
        C.register_validator(no_flash_on_cpu)
        cfg = parse_cli(["--data.shuffle_buffer", "10"])
        assert cfg.data.shuffle_buffer == 10 and isinstance(cfg.data, DataConf)
        with pytest.raises(ConfigError, match="data.shufle_buffer"):
            parse_cli(["--data.shufle_buffer", "10"])
        with pytest.raises(ConfigError, match="model.attn"):
            parse_cli(["--model.attn", "flash_attn"])
    finally:
        C.SECTIONS.clear()
        C.SECTIONS.update(saved[0])
        C.VALIDATORS[:] = saved[1]


def test_paths_checked_before_data(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    cfg = parse_cli(["--output_dir", str(tmp_path / "new" / "exp"), "--train_data", str(data)])
    check_paths(cfg)
    assert (tmp_path / "new" / "exp").is_dir()  # created
    with pytest.raises(ConfigError, match="run.train_data"):
        check_paths(parse_cli(["--output_dir", str(tmp_path), "--train_data", str(tmp_path / "nope")]))
    with pytest.raises(ConfigError, match="run.output_dir"):
        check_paths(parse_cli(["--train_data", str(data)]))
    exp = ["--output_dir", str(tmp_path / "exp2"), "--train_data", str(data)]
    with pytest.raises(ConfigError, match="run.resume.*no checkpoint"):
        check_paths(parse_cli(exp + ["--resume"]))
    ckpt = tmp_path / "exp2" / "checkpoints" / "step_00000005"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text("{}")
    with pytest.raises(ConfigError, match="run.resume: never"):
        check_paths(parse_cli(exp + ["--resume", "never"]))
    check_paths(parse_cli(exp))  # auto resumes


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_output_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(ConfigError, match="cannot write"):
        prepare_output_dir(ro / "exp")


def test_unwritable_output_dir_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="run.output_dir: cannot write"):
        prepare_output_dir(f / "exp")


def test_save_config_round_trips_and_keeps_old(tmp_path):
    cfg = parse_cli(["--train.lr", "2e-4"])
    path = save_config(cfg, tmp_path)
    again = build_config(str(path))
    assert again.to_dict() == cfg.to_dict()
    save_config(parse_cli(["--train.lr", "3e-4"]), tmp_path)
    assert (tmp_path / "config.1.yaml").is_file()
    assert yaml.safe_load(path.read_text())["train"]["lr"] == 3e-4


def test_train_cli_exit_codes(tmp_path, capsys):
    from west.bin import train

    assert train.main(["--train.lrr", "1"]) == 2
    assert "train.lrr" in capsys.readouterr().err
    data = tmp_path / "list.jsonl"
    data.write_text("")
    rc = train.main(["--output_dir", str(tmp_path / "exp"), "--train_data", str(data), "--seed", "3"])
    assert rc == 2  # rejected before any data is read: no LLM to build
    assert "model.llm.path: required" in capsys.readouterr().err


def test_decode_cli_checks(tmp_path, capsys):
    from west.bin import decode

    assert decode.main(["--checkpoint", str(tmp_path), "--data", "x", "--result", "y"]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err
    ck = tmp_path / "checkpoints" / "step_00000002"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    assert decode.resolve_checkpoint(str(tmp_path)) == ck
    assert decode.main(["--checkpoint", str(ck), "--data", str(tmp_path / "no"), "--result", "y"]) == 2
