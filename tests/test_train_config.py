"""Config: YAML + typed overrides + CLI flags, errors naming the key, saved config.yaml."""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from west.bin.train import parse_train_args
from west.config import Config, ConfigError, load_config, split_overrides
from west.data.config import DataConfig
from west.models.config import ConformerConfig, LoraSettings, ProjectorConfig, SpeechLLMConfig
from west.shapes import SpeechShape
from west.train.rundir import check_paths, prepare_output_dir, save_config

from helpers.e2e import tiny_encoder


@pytest.fixture
def llm(tmp_path):
    """A directory that passes the model.llm.path check (a HF model dir has a config.json)."""
    d = tmp_path / "llm"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


@pytest.fixture
def conf(tmp_path, llm):
    p = tmp_path / "conf.yaml"
    p.write_text(yaml.safe_dump({
        "train": {"lr": "1e-4", "betas": [0.9, 0.95], "precision": "bf16"},  # "1e-4" is a str in YAML 1.1
        "data": {"batch_type": "pack", "pack_tokens": 4096, "num_workers": 2},
        "model": {"llm": {"path": llm}, "freeze_llm": True},
    }))
    return str(p)


def parse(argv, llm):
    return parse_train_args([*argv, "--model.llm.path", llm])


def test_yaml_flags_and_overrides_are_typed(conf, tmp_path):
    cfg = parse_train_args(["--config", conf, "--output_dir", str(tmp_path / "exp"), "--max_steps", "20",
                            "--seed", "7", "--train.lr", "3e-4", "--train.betas", "0.8,0.9",
                            "--train.grad_checkpointing", "true", "--model.freeze_llm=false",
                            "--data.num_workers", "4", "--model.lora.target_modules", "[q, v]", "--audit"])
    t = cfg.train
    assert t.lr == 3e-4 and isinstance(t.lr, float)
    assert t.betas == [0.8, 0.9] and t.precision == "bf16" and t.grad_checkpointing is True
    assert t.max_steps == 20 and t.seed == 7
    assert cfg.model.freeze_llm is False and cfg.model.lora.target_modules == ["q", "v"]
    assert cfg.model.llm.path == str(tmp_path / "llm")
    assert cfg.data.num_workers == 4 and cfg.data.pack_tokens == 4096
    assert cfg.run.audit is True and cfg.run.output_dir.endswith("exp")
    assert cfg.data.batch_type == "pack"
    with pytest.raises(ConfigError, match=r"^model\.new_key: unknown key"):
        parse_train_args(["--config", conf, "--model.new_key", "[1, 2]"])


def test_preempt_signals_parse(llm):
    assert parse([], llm).train.preempt_signals == ["SIGTERM", "SIGUSR1"]
    assert parse(["--train.preempt_signals", "SIGUSR1"], llm).train.preempt_signals == ["SIGUSR1"]
    assert parse(["--train.preempt_signals", "[]"], llm).train.preempt_signals == []  # off


def test_yaml_float_written_without_dot_is_read(llm):
    cfg = load_config(None, [("train.lr", "5e-5"), ("model.llm.path", llm)])
    assert cfg.train.lr == 5e-5


BAD = [  # (command line, the key the error must start with), across all four sections
    (["--train.lrr", "1"], "train.lrr"),
    (["--train.lr", "fast"], "train.lr"),
    (["--train.lr", "0"], "train.lr"),
    (["--train.accum_steps", "1.5"], "train.accum_steps"),
    (["--train.grad_checkpointing", "maybe"], "train.grad_checkpointing"),
    (["--optim.lr", "1"], "optim"),
    (["--lr", "1"], "--lr"),
    (["--train.precision", "fp16"], "train.precision"),
    (["--train.max_steps", "0", "--train.max_epochs", "0"], "train.max_steps"),
    (["--train.accum_steps", "0"], "train.accum_steps"),
    (["--train.preempt_signals", "TERM"], "train.preempt_signals"),            # signal names: SIGTERM
    (["--train.preempt_signals", "SIGTERM,SIGKILL"], "train.preempt_signals"),  # cannot be caught
    (["--train.betas", "0.9"], "train.betas"),
    (["--train.betas", "0.9,1.5"], "train.betas"),
    (["--train.min_lr_ratio", "2"], "train.min_lr_ratio"),
    (["--train.device", "tpu"], "train.device"),
    (["--train.dist_timeout_s", "0"], "train.dist_timeout_s"),
    (["--train.keep_last", "0"], "train.keep_last"),
    (["--train.monitor_interval_s", "-1"], "train.monitor_interval_s"),
    (["--train.profile_active", "0"], "train.profile_active"),
    (["--train.profile_wait", "-1"], "train.profile_wait"),
    (["--batch_type", "pack", "--batch_size", "16"], "data.batch_size"),
    (["--batch_type", "static", "--pack_tokens", "8192"], "data.pack_tokens"),
    (["--batch_type", "static", "--max_tokens_in_batch", "8192"], "data.max_tokens_in_batch"),
    (["--batch_type", "dynamic", "--max_tokens_in_batch", "0"], "data.max_tokens_in_batch"),
    (["--batch_type", "bucket"], "data.batch_type"),
    (["--resume", "/no/such/ckpt"], "run.resume"),
    (["--run.audit", "maybe"], "run.audit"),
    (["--data.batch_size", "many"], "data.batch_size"),
    (["--data.shuffle", "garbage"], "data.shuffle"),
    (["--data.encoder_layout", "ragged"], "data.encoder_layout"),
    (["--batch_type", "static", "--data.shared_prefix", "true"], "data.shared_prefix"),   # one sample a row
    (["--batch_type", "pack", "--data.shared_prefix", "true", "--model.llm.attn_implementation", "sdpa"],
     "data.shared_prefix"),
    (["--train.cuda_graphs", "true"], "train.cuda_graphs"),              # removed keys are unknown
    (["--batch_type", "pack", "--data.shared_prefix", "true", "--train.compile", "true"], "data.shared_prefix"),
    (["--data.data_type", "csv"], "data.data_type"),
    (["--data.pack_algorithm", "best"], "data.pack_algorithm"),
    (["--data.pack_cost", "cubic"], "data.pack_cost"),
    (["--data.plan_window", "0"], "data.plan_window"),
    (["--data.num_workers", "-1"], "data.num_workers"),
    (["--data.frame_shift_ms", "0"], "data.frame_shift_ms"),
    (["--data.min_duration", "2", "--data.max_duration", "1"], "data.max_duration"),
    (["--data.prompt", "no marker here"], "data.prompt"),
    (["--data.weights", "1,0"], "data.weights"),
    (["--data.shufle", "true"], "data.shufle"),
    (["--data.plan", "always"], "data.plan"),                          # removed keys are unknown
    (["--data.subsampling_rate", "4"], "data.subsampling_rate"),        # geometry is the model's
    (["--data.num_mel_bins", "64"], "data.num_mel_bins"),                # the encoder reads 80 (input_dim)
    (["--model.encoder.conv_kernel", "4"], "model.encoder.conv_kernel"),
    (["--model.encoder.d_model", "65"], "model.encoder.d_model"),
    (["--model.encoder.subsampling_rate", "5"], "model.encoder.subsampling_rate"),
    (["--model.encoder.d_modle", "128"], "model.encoder.d_modle"),
    (["--model.encoder.init", "/no/such/encoder.safetensors"], "model.encoder.init"),
    (["--model.encoder.type", "whisper", "--model.encoder.path", "/w", "--data.features", "whisper",
      "--model.encoder.init", "encoder.safetensors"], "model.encoder.init"),            # the Conformer's only
    (["--model.projector.stride", "0"], "model.projector.stride"),
    (["--model.projector.type", "conv"], "model.projector.type"),
    (["--model.projector.type", "ctc_posterior"], "model.ctc_weight"),
    (["--model.ctc_weight", "-1"], "model.ctc_weight"),
    (["--model.ctc_blank", "-1"], "model.ctc_blank"),
    (["--model.ctc_blank", "true"], "model.ctc_blank"),
    (["--model.freeze_llm", "garbage"], "model.freeze_llm"),
    (["--model.llm.dtype", "float8"], "model.llm.dtype"),
    (["--model.llm.attn_backend", "magic"], "model.llm.attn_backend"),
    (["--model.llm.attn_backend", "flex", "--train.device", "cpu"], "model.llm.attn_backend"),
    (["--model.llm.attn_implementation", "flash_attention_2", "--train.device", "cpu"],
     "model.llm.attn_implementation"),
    (["--model.lora", "[8]"], "model.lora"),
    (["--model.llm.fused_qkv", "true"], "model.llm.fused_qkv"),
    (["--model.lora.r", "0"], "model.lora.r"),
]


@pytest.mark.parametrize("argv, key", BAD)
def test_errors_name_the_key(argv, key, llm):
    with pytest.raises(ConfigError, match="^" + re.escape(key)):
        parse(argv, llm)


def test_llm_path_is_a_model_dir(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.llm\.path: required"):
        parse_train_args([])
    with pytest.raises(ConfigError, match=r"^model\.llm\.path: no such directory"):
        parse_train_args(["--model.llm.path", str(tmp_path / "none")])
    with pytest.raises(ConfigError, match=r"^model\.llm\.path: .* \(no config\.json\)"):
        parse_train_args(["--model.llm.path", str(tmp_path)])


@pytest.mark.parametrize("text, value", [("true", True), ("False", False), ("yes", True), ("no", False),
                                         ("on", True), ("off", False), ("1", True), ("0", False)])
def test_booleans_parse_one_way(text, value, llm):
    cfg = parse(["--train.fsdp", text, "--data.shuffle", text, "--model.freeze_llm", text, "--run.audit", text], llm)
    assert cfg.train.fsdp is cfg.data.shuffle is cfg.model.freeze_llm is cfg.run.audit is value


def test_sections_built_in_code_are_checked_the_same_way():
    assert DataConfig(batch_size="8").batch_size == 8              # typed like a loaded config
    with pytest.raises(ConfigError, match=r"^data\.shuffle: cannot read 'garbage' as bool"):
        DataConfig(shuffle="garbage")
    with pytest.raises(ConfigError, match=r"^data\.packtokens: unknown key"):
        DataConfig.from_dict({"packtokens": 8192})
    with pytest.raises(ConfigError, match=r"^model\.encoder\.conv_kernel: must be odd"):
        ConformerConfig(conv_kernel=4)
    with pytest.raises(ConfigError, match=r"^model\.encoder\.d_model"):
        tiny_encoder(d_model=66)
    with pytest.raises(ConfigError, match=r"^model\.ctc_weight"):
        SpeechLLMConfig(projector=ProjectorConfig(type="ctc_posterior"))
    m = SpeechLLMConfig(encoder=tiny_encoder(subsampling_rate=6, input_dim=64), projector={"stride": 3},
                        lora=LoraSettings(r=4), ctc_weight=1.0)
    assert m.projector.stride == 3
    assert m.speech_shape() == SpeechShape(subsampling_rate=6, projector_stride=3, num_mel_bins=64)  # encoder's width
    assert SpeechLLMConfig.from_dict(m.to_dict()) == m


def test_nested_and_whole_block_overrides(llm):
    cfg = parse(["--model.encoder.num_blocks", "3", "--model.projector.dropout", "1e-1", "--model.lora", "{r: 4}",
                 "--model.lora.alpha", "8", "--model.encoder.subsampling_rate", "6",
                 "--model.projector.stride", "3"], llm)
    assert cfg.model.encoder.num_blocks == 3 and cfg.model.projector.dropout == 0.1
    assert (cfg.model.lora.r, cfg.model.lora.alpha) == (4, 8)
    assert cfg.model.speech_shape() == SpeechShape(subsampling_rate=6, projector_stride=3, num_mel_bins=80)
    assert not hasattr(cfg.data, "subsampling_rate") and not hasattr(cfg.data, "projector_stride")
    assert parse(["--model.lora", "{r: 4}", "--model.lora", "none"], llm).model.lora is None
    assert parse(["--model.lora", "null", "--model.lora.r", "2"], llm).model.lora.r == 2


def test_unknown_section_and_key_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trian:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="^trian: unknown section 'trian'"):
        load_config(str(p))
    p.write_text("train:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match=r"^train\.learning_rate"):
        load_config(str(p))
    p.write_text("decode:\n  beam: 1\n")                                 # the dead section is gone
    with pytest.raises(ConfigError, match="^decode: unknown section"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "missing.yaml"))


def test_batch_type_flags_fit_their_mode(llm):
    cfg = parse(["--batch_type", "dynamic", "--max_tokens_in_batch", "2048"], llm)
    assert cfg.data.max_tokens_in_batch == 2048
    cfg = parse(["--batch_type", "static", "--batch_size", "8"], llm)
    assert cfg.data.batch_size == 8


def test_feature_width_follows_the_encoder(llm):
    assert parse(["--model.encoder.input_dim", "64"], llm).data.num_mel_bins == 64
    assert parse(["--model.encoder.input_dim", "64", "--data.num_mel_bins", "64"], llm).data.num_mel_bins == 64


def test_split_overrides():
    assert split_overrides(["--a.b", "1", "--c.d=x=y"]) == [("a.b", "1"), ("c.d", "x=y")]
    with pytest.raises(ConfigError, match="missing value"):
        split_overrides(["--a.b"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        split_overrides(["a.b", "1"])


def test_several_train_lists(tmp_path, llm):
    a, b = tmp_path / "a.list", tmp_path / "b.list"
    a.write_text("")
    b.write_text("")
    cfg = parse(["--train_data", f"{a},{b}", "--output_dir", str(tmp_path / "exp")], llm)
    assert cfg.run.train_data == [str(a), str(b)] and cfg.data.weights is None
    check_paths(cfg)
    with pytest.raises(ConfigError, match=r"^run\.train_data: no such file: .*nope"):
        check_paths(parse(["--train_data", f"{a},{tmp_path / 'nope'}", "--output_dir", str(tmp_path / "e")], llm))
    cfg = parse(["--train_data", f"{a},{b}", "--data.weights", "1,3"], llm)
    assert cfg.data.weights == [1.0, 3.0]
    with pytest.raises(ConfigError, match=r"^data\.weights: 3 weights for 2 lists"):
        parse(["--train_data", f"{a},{b}", "--data.weights", "1,2,3"], llm)
    with pytest.raises(ConfigError, match=r"^data\.weights"):
        parse(["--train_data", f"{a},{b}", "--data.weights", "1,-2"], llm)


@pytest.mark.parametrize("run, data, want", [
    ({"train_data": ["a.list", "b.list"]}, {}, (["a.list", "b.list"], None)),
    ({"train_data": [{"path": "a.list", "weight": 1}, {"path": "b.list", "weight": 0.5}]}, {},
     (["a.list", "b.list"], [1.0, 0.5])),
    ({"train_data": "a.list"}, {"weights": [2]}, (["a.list"], [2.0])),
])
def test_train_lists_in_yaml(tmp_path, llm, run, data, want):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"run": run, "data": data, "model": {"llm": {"path": llm}}}))
    cfg = load_config(str(p))
    assert (cfg.run.train_data, cfg.data.weights) == want


@pytest.mark.parametrize("run, data, key", [
    ({"train_data": [{"path": "a.list", "weight": 1}]}, {"weights": [1]}, "data.weights"),      # both forms
    ({"train_data": [{"path": "a.list", "weight": 1}, "b.list"]}, {}, "run.train_data"),       # mixed
    ({"train_data": [{"path": "a.list", "weight": -1}]}, {}, "data.weights"),
    ({"train_data": [{"path": "a.list", "weight": 1}, {"path": "b.list"}]}, {}, "run.train_data"),
    ({"train_data": ["a.list", "b.list"]}, {"weights": [1]}, "data.weights"),                  # count
])
def test_train_list_errors_in_yaml(tmp_path, llm, run, data, key):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"run": run, "data": data, "model": {"llm": {"path": llm}}}))
    with pytest.raises(ConfigError, match="^" + re.escape(key)):
        load_config(str(p))


def test_paths_checked_before_data(tmp_path, llm):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    cfg = parse(["--output_dir", str(tmp_path / "new" / "exp"), "--train_data", str(data)], llm)
    check_paths(cfg)
    assert (tmp_path / "new" / "exp").is_dir()  # created
    with pytest.raises(ConfigError, match="run.train_data"):
        check_paths(parse(["--output_dir", str(tmp_path), "--train_data", str(tmp_path / "nope")], llm))
    with pytest.raises(ConfigError, match="run.output_dir"):
        check_paths(parse(["--train_data", str(data)], llm))
    with pytest.raises(ConfigError, match="run.train_data: required"):
        check_paths(parse(["--output_dir", str(tmp_path / "exp3")], llm))
    exp = ["--output_dir", str(tmp_path / "exp2"), "--train_data", str(data)]
    with pytest.raises(ConfigError, match="run.resume.*no checkpoint"):
        check_paths(parse(exp + ["--resume"], llm))
    ckpt = tmp_path / "exp2" / "checkpoints" / "step_00000005"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text("{}")
    with pytest.raises(ConfigError, match="run.resume: never"):
        check_paths(parse(exp + ["--resume", "never"], llm))
    check_paths(parse(exp, llm))  # auto resumes (the trainer then reports the unusable checkpoint)
    with pytest.raises(ConfigError, match="run.resume: .*step_00000005: not a usable checkpoint \\(meta.json"):
        check_paths(parse(exp + ["--resume", str(ckpt)], llm))  # an explicit dir must be whole


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


def test_save_config_round_trips_and_keeps_old(tmp_path, llm):
    cfg = parse(["--train.lr", "2e-4", "--train_data", "a.list,b.list", "--data.weights", "1,2",
                 "--model.lora", "{r: 4}", "--data.cmvn", "none"], llm)
    path = save_config(cfg, tmp_path)
    again = load_config(str(path))
    assert again.to_dict() == cfg.to_dict() and again == cfg
    assert set(yaml.safe_load(path.read_text())) == {"run", "train", "data", "model"}
    save_config(parse(["--train.lr", "3e-4"], llm), tmp_path)
    assert (tmp_path / "config.1.yaml").is_file()
    assert yaml.safe_load(path.read_text())["train"]["lr"] == 3e-4


def test_defaults_and_help(capsys):
    assert Config().to_dict()["data"] == DataConfig().to_dict()
    with pytest.raises(SystemExit):
        parse_train_args(["--help"])
    out = capsys.readouterr().out
    assert "comma-separated for several" in out and "--pack_tokens" in out and "--cv_data" in out
    assert "sections: run, train, data, model\n" in out  # no decode section
    assert "keep_best" in out and "eval_every" in out


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
    with pytest.raises(FileNotFoundError, match="nor a run dir with one"):
        decode.resolve_checkpoint(str(tmp_path))  # its only checkpoint is unusable: reported, not taken
    assert "step_00000002 is not usable (meta.json: no integer step" in capsys.readouterr().err
    assert decode.main(["--checkpoint", str(ck), "--data", str(tmp_path / "no"), "--result", "y"]) == 2


def test_every_key_is_documented():
    """docs/config.md has a row for every key of every section (a new key without one fails here)."""
    doc = (Path(__file__).parents[1] / "docs" / "config.md").read_text(encoding="utf-8")
    sections = {"run": Config().run, "train": Config().train, "data": DataConfig(), "model": SpeechLLMConfig(),
                "model.encoder": ConformerConfig(), "model.projector": ProjectorConfig(),
                "model.llm": SpeechLLMConfig().llm, "model.lora": LoraSettings()}
    for name, sec in sections.items():
        table = doc.split(f"# `{name}`", 1)[1].split("\n#", 1)[0]  # from the section's heading to the next
        for f in dataclasses.fields(sec):
            if not dataclasses.is_dataclass(getattr(sec, f.name)):
                assert f"\n| `{f.name}` |" in table, f"{name}.{f.name} is not in docs/config.md"
