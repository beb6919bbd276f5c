"""A run's one config tree (run/train/data/model), its loader, run directory and west-train's flags.

``load_config``: a YAML file, then ``--section.key VALUE`` overrides in order (nested keys
``--model.encoder.d_model 128``, whole blocks ``--model.lora "{r: 8}"`` or ``none``); each
section types and checks its own fields (west.schema), then the few checks across sections
run. Every error is a ConfigError starting with the dotted key, raised before data is read.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from dataclasses import field
from pathlib import Path
from typing import Sequence

import yaml

from west.data.config import BATCH_TYPES, DataConfig
from west.models.config import SpeechLLMConfig
from west.schema import ConfigError, require, section
from west.train.config import RunConfig, TrainConfig

SECTIONS = ("run", "train", "data", "model")


@section("")
class Config:
    """The whole config of a run; ``explicit`` holds the dotted keys set on the command line."""

    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: SpeechLLMConfig = field(default_factory=SpeechLLMConfig)
    explicit: set = field(default_factory=set, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


def set_override(raw: dict, dotted: str, value: str) -> None:
    """``--model.encoder.d_model 128`` -> raw["model"]["encoder"]["d_model"] = "128" (typed when built)."""
    parts, node = dotted.split("."), raw
    for part in parts[:-1]:
        child = node.get(part)
        child = yaml.safe_load(child) if isinstance(child, str) else child  # a block given whole before
        node[part] = node = child if isinstance(child, dict) else {}
    node[parts[-1]] = value


def split_weighted_lists(raw: dict) -> None:
    """``run.train_data: [{path, weight}, ...]`` -> the paths, and the weights into ``data.weights``."""
    run, data = raw.get("run"), raw.setdefault("data", {})
    lists = run.get("train_data") if isinstance(run, dict) else None
    lists = yaml.safe_load(lists) if isinstance(lists, str) and lists.strip().startswith("[") else lists
    if not isinstance(lists, list) or not any(isinstance(x, dict) for x in lists) or not isinstance(data, dict):
        return
    require(all(isinstance(x, dict) and set(x) == {"path", "weight"} for x in lists), "run.train_data",
            f"give all lists as paths or all as {{path, weight}} mappings, got {lists!r}")
    require(data.get("weights") is None, "data.weights",
            "given twice: in run.train_data's {path, weight} entries and in data.weights (keep one)")
    run["train_data"], data["weights"] = [x["path"] for x in lists], [x["weight"] for x in lists]


def merge(yaml_path: str | None = None, overrides: Sequence[tuple[str, str]] = ()) -> dict:
    """The YAML file's sections with the overrides applied, not typed yet (tools that need
    one section build it from here: ``DataConfig.from_dict(merge(...).get("data", {}))``)."""
    raw = {}
    if yaml_path:
        require(os.path.isfile(yaml_path), "--config", f"no such file: {yaml_path}")
        try:
            raw = yaml.safe_load(Path(yaml_path).read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config: {yaml_path} is not valid YAML: {e}") from None
        require(isinstance(raw, dict), "--config", f"{yaml_path}: the top level must be a mapping of sections")
        raw = {name: sec or {} for name, sec in raw.items()}
    for dotted, value in overrides:
        set_override(raw, dotted, value)
    for name in raw:
        require(name in SECTIONS, str(name), f"unknown section {name!r} (known: {', '.join(SECTIONS)})")
    split_weighted_lists(raw)
    return raw


def load_config(yaml_path: str | None = None, overrides: Sequence[tuple[str, str]] = ()) -> Config:
    """YAML file + ordered ``(section.key, value)`` overrides -> typed, validated Config."""
    cfg = Config(**merge(yaml_path, overrides), explicit={dotted for dotted, _ in overrides})
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """The checks that span sections or look outside the config (fields were checked when built)."""
    from west.data.policies import POLICIES  # the data side says which key sizes each batch mode

    data, run, llm = cfg.data, cfg.run, cfg.model.llm
    used = POLICIES[data.batch_type].size_key
    for key in sorted({p.size_key for p in POLICIES.values()} - {used}):
        require(f"data.{key}" not in cfg.explicit, f"data.{key}",
                f"not used with data.batch_type={data.batch_type} (that mode is sized by data.{used})")
    require(data.weights is None or not run.train_data or len(data.weights) == len(run.train_data),
            "data.weights", f"{len(data.weights or [])} weights for {len(run.train_data)} lists in run.train_data")
    require(llm.path, "model.llm.path",
            "required: the tokenizer and the LLM are loaded from this directory (--model.llm.path DIR)")
    require(os.path.isdir(llm.path), "model.llm.path", f"no such directory: {llm.path}")
    require(os.path.isfile(os.path.join(llm.path, "config.json")), "model.llm.path",
            f"{llm.path} is not a Hugging Face model directory (no config.json)")
    check_attention_device(cfg)


def check_attention_device(cfg: Config) -> None:
    """flash-attn needs CUDA and its package, FlexAttention cannot train on CPU: no silent
    fallback, a config written for GPUs fails on CPU with the override that runs there."""
    from west.models.attention import BACKENDS
    from west.train.distributed import resolved_device

    impl, backend = cfg.model.llm.attn_implementation, cfg.model.llm.attn_backend
    require(backend in BACKENDS, "model.llm.attn_backend", f"must be one of {BACKENDS}, got {backend!r}")
    on_cpu = resolved_device(cfg.train.device) != "cuda"
    flash = ("model.llm.attn_implementation", impl) if impl.startswith("flash_attention") else \
        ("model.llm.attn_backend", "flash") if impl == "west_varlen" and backend == "flash" else None
    if flash:
        require(not on_cpu, flash[0], f"{flash[1]} needs a CUDA device, but train.device={cfg.train.device} "
                "resolves to cpu; on CPU use --model.llm.attn_implementation west_varlen "
                "--model.llm.attn_backend auto (per-sample SDPA, exact)")
        require(importlib.util.find_spec("flash_attn"), flash[0],
                f"{flash[1]} needs the flash-attn package: pip install 'west[gpu]'")
    require(not (on_cpu and impl == "west_varlen" and backend == "flex"), "model.llm.attn_backend",
            "flex cannot train on CPU (FlexAttention has no CPU backward); use auto")


def check_paths(cfg: Config, need_train_data: bool = True) -> None:
    """Inputs exist, the output dir is writable (created if missing), ``run.resume`` fits it."""
    from west.train.checkpoint import find_latest  # lazy: keeps `--help` torch-free

    r = cfg.run
    require(r.output_dir, "run.output_dir", "required (--output_dir DIR)")
    if need_train_data:
        require(r.train_data, "run.train_data", "required (--train_data LIST[,LIST...])")
        for path in r.train_data:
            require(os.path.exists(path), "run.train_data", f"no such file: {path}")
    prepare_output_dir(r.output_dir)
    latest = find_latest(Path(r.output_dir) / "checkpoints")
    require(not (r.resume == "never" and latest), "run.resume",
            f"never, but {latest} exists: use a new --output_dir or --resume auto")
    require(not (r.resume == "must" and latest is None), "run.resume",
            f"--resume given but {r.output_dir}/checkpoints holds no checkpoint")


def prepare_output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if missing and prove it is writable, or raise naming it."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write_test.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run.output_dir: cannot write to {p}: {e.strerror or e}") from None
    return p


def save_config(cfg: Config, output_dir: str | os.PathLike) -> Path:
    """Write the resolved config to DIR/config.yaml (atomically); keep a differing old one."""
    out = Path(output_dir) / "config.yaml"
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True)
    if out.exists() and out.read_text(encoding="utf-8") != text:
        n = 1
        while (out.parent / f"config.{n}.yaml").exists():
            n += 1
        out.rename(out.parent / f"config.{n}.yaml")
    tmp = out.with_suffix(f".yaml.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out


FLAGS = {  # west-train's top-level flags: the key each one sets, and its help
    "train_data": ("run.train_data", "data list(s) (jsonl / kaldi-style / shard list), comma-separated for several"),
    "output_dir": ("run.output_dir", "run directory: checkpoints, logs, config.yaml"),
    "batch_type": ("data.batch_type", "|".join(BATCH_TYPES)),
    "batch_size": ("data.batch_size", "static: utterances per batch"),
    "max_tokens_in_batch": ("data.max_tokens_in_batch", "dynamic: padded LLM tokens per batch"),
    "pack_tokens": ("data.pack_tokens", "pack: LLM tokens per packed row"),
    "max_steps": ("train.max_steps", "optimizer steps (0 = use train.max_epochs)"),
    "seed": ("train.seed", "random seed"),
    "resume": ("run.resume", "auto (default: resume if DIR has one), never, must (bare --resume) or a checkpoint dir"),
    "audit": ("run.audit", "write DIR/audit/rank{R}.jsonl with the utterance keys of every step"),
}


def build_arg_parser(prog: str = "west-train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a speech LLM. Any config key can be overridden as --section.key VALUE "
                    "(typed like the key); see docs/training.md.",
        epilog=f"sections: {', '.join(SECTIONS)}\ntrain keys: "
               f"{', '.join(f.name for f in dataclasses.fields(TrainConfig))}")
    p.add_argument("--config", help=f"YAML file with sections {'/'.join(SECTIONS)}")
    extra = {"resume": dict(nargs="?", const="must"), "audit": dict(action="store_const", const="true")}
    for flag, (key, text) in FLAGS.items():
        p.add_argument(f"--{flag}", help=f"{text} [{key}]", **extra.get(flag, {}))
    return p


def split_overrides(rest: Sequence[str]) -> list[tuple[str, str]]:
    """``--section.key VALUE`` / ``--section.key=VALUE`` pairs -> [(dotted, value)], in order."""
    out, i = [], 0
    while i < len(rest):
        tok = rest[i]
        require(tok.startswith("--"), repr(tok), "unexpected argument (overrides are --section.key VALUE)")
        if "=" in tok:
            dotted, value = tok[2:].split("=", 1)
            i += 1
        else:
            require(i + 1 < len(rest), tok, "missing value")
            dotted, value = tok[2:], rest[i + 1]
            i += 2
        require("." in dotted, f"--{dotted}", "unknown option")
        out.append((dotted, value))
    return out


def parse_train_args(argv: Sequence[str] | None = None, prog: str = "west-train") -> Config:
    """west-train's command line -> validated Config (no file besides --config is read)."""
    args, rest = build_arg_parser(prog).parse_known_args(argv)
    flags = [(FLAGS[k][0], v) for k, v in vars(args).items() if k in FLAGS and v is not None]
    return load_config(args.config, flags + split_overrides(rest))  # --section.key wins over flags
