"""Command line and run directory: flags -> Config, path checks, DIR/config.yaml.

``parse_cli`` maps the top-level flags of ``west-train`` onto config keys and
applies ``--section.key VALUE`` overrides (see west.train.config for typing and
validation); ``check_paths`` and ``prepare_output_dir`` catch missing inputs and
unwritable output dirs before any data is read.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Sequence

import yaml

from west.train.config import (BATCH_TYPE_KEY, SECTIONS, Config, ConfigError, RunConfig, TrainConfig,
                               build_config, require)

# Top-level CLI flags of issue 5 and the config key each one sets.
FLAG_KEYS: dict[str, str] = {
    "train_data": "run.train_data",
    "output_dir": "run.output_dir",
    "resume": "run.resume",
    "audit": "run.audit",
    "batch_type": "data.batch_type",
    "batch_size": "data.batch_size",
    "max_tokens_in_batch": "data.max_tokens_in_batch",
    "pack_tokens": "data.pack_tokens",
    "max_steps": "train.max_steps",
    "seed": "train.seed",
}


def check_paths(cfg: Config, need_train_data: bool = True) -> None:
    """Inputs exist and the output dir is writable (created if missing)."""
    r: RunConfig = cfg.run
    require(bool(r.output_dir), "run.output_dir", "required (--output_dir DIR)")
    if need_train_data:
        require(bool(r.train_data), "run.train_data", "required (--train_data LIST)")
        for path in r.train_data.split(","):
            require(os.path.exists(path), "run.train_data", f"no such file: {path}")
    prepare_output_dir(r.output_dir)
    from west.train.checkpoint import find_latest  # lazy: keeps `--help` torch-free

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


# ----------------------------------------------------------------------------- CLI

def build_arg_parser(prog: str = "west-train") -> argparse.ArgumentParser:
    train_keys = ", ".join(f.name for f in dataclasses.fields(TrainConfig))
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a speech LLM. Any config key can be overridden as --section.key VALUE "
                    "(typed like the key's current value); see docs/training.md.",
        epilog=f"sections: {', '.join(SECTIONS)}\ntrain keys: {train_keys}")
    p.add_argument("--config", help="YAML file with sections run/train/data/model/decode")
    p.add_argument("--train_data", help="data list (jsonl / kaldi-style), comma-separated for several")
    p.add_argument("--output_dir", help="run directory: checkpoints, logs, config.yaml")
    p.add_argument("--batch_type", choices=sorted(BATCH_TYPE_KEY))
    p.add_argument("--batch_size", type=int, help="static: utterances per batch")
    p.add_argument("--max_tokens_in_batch", type=int, help="dynamic: padded LLM tokens per batch")
    p.add_argument("--pack_tokens", type=int, help="pack: LLM tokens per packed row")
    p.add_argument("--max_steps", type=int, help="optimizer steps (0 = use train.max_epochs)")
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", nargs="?", const="must",
                   help="auto (default: resume if DIR has a checkpoint), never, must "
                        "(bare --resume) or a checkpoint dir")
    p.add_argument("--audit", action="store_const", const="true",
                   help="write DIR/audit/rank{R}.jsonl with the utterance keys of every step")
    return p


def split_overrides(rest: Sequence[str]) -> list[tuple[str, str]]:
    """``--section.key VALUE`` / ``--section.key=VALUE`` pairs -> [(dotted, value)], in order."""
    out, i = [], 0
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r} (overrides are --section.key VALUE)")
        if "=" in tok:
            dotted, value = tok[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(rest):
                raise ConfigError(f"{tok}: missing value")
            dotted, value = tok[2:], rest[i + 1]
            i += 2
        if "." not in dotted:
            raise ConfigError(f"--{dotted}: unknown option")
        out.append((dotted, value))
    return out


def parse_cli(argv: Sequence[str] | None = None, prog: str = "west-train") -> Config:
    """Command line -> validated Config (no file besides --config is read)."""
    args, rest = build_arg_parser(prog).parse_known_args(argv)
    overrides = []
    for flag, dotted in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.append((dotted, str(value)))
    overrides += split_overrides(rest)  # explicit --section.key wins over short flags
    return build_config(args.config, overrides)
