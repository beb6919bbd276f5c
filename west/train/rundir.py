"""The run directory: inputs exist, the output dir is writable, ``run.resume`` fits what
is there, and the resolved config is saved as DIR/config.yaml. Checked before any data is read."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from west.config import Config
from west.schema import ConfigError, require


def check_paths(cfg: Config, need_train_data: bool = True) -> None:
    """Inputs exist, the output dir is writable (created if missing), ``run.resume`` fits it."""
    from west.checkpoint.integrity import check_checkpoint, latest_usable  # lazy: keeps `--help` light

    r = cfg.run
    require(r.output_dir, "run.output_dir", "required (--output_dir DIR)")
    if need_train_data:
        require(r.train_data, "run.train_data", "required (--train_data LIST[,LIST...])")
        for path in r.train_data:
            require(os.path.exists(path), "run.train_data", f"no such file: {path}")
    check_cv_data(cfg)
    prepare_output_dir(r.output_dir)
    latest, bad = latest_usable(Path(r.output_dir) / "checkpoints")  # the trainer reports bad ones
    found = latest or (bad[0][0] if bad else None)
    require(not (r.resume == "never" and found), "run.resume",
            f"never, but {found} exists: use a new --output_dir or --resume auto")
    if r.resume not in ("auto", "never", "must"):  # a checkpoint dir: whole, or refused before any data is read
        problem = check_checkpoint(r.resume)
        require(problem is None, "run.resume", f"{r.resume}: not a usable checkpoint ({problem})")
    require(not (r.resume == "must" and latest is None), "run.resume",
            f"--resume given but {r.output_dir}/checkpoints holds no checkpoint" +
            (f" that is usable ({bad[0][0].name}: {bad[0][1]})" if bad else ""))


def check_cv_data(cfg: Config) -> None:
    """``run.cv_data`` exists and holds at least one record; best checkpoints need it."""
    from west.data.lists import open_list  # lazy: keeps `--help` torch-free
    from west.data.stats import DataStats  # light --help

    path = cfg.run.cv_data
    require(path or cfg.train.keep_best == 0, "train.keep_best",
            f"{cfg.train.keep_best} best checkpoints need a dev list: give --cv_data LIST (run.cv_data)")
    if not path:
        return
    require(os.path.exists(path), "run.cv_data", f"no such file: {path}")
    stats = DataStats(max_warnings=0)
    try:
        n = len(open_list(path, stats, cfg.data.data_type, conf=cfg.data))
    except (OSError, ValueError) as e:
        raise ConfigError(f"run.cv_data: cannot read {path}: {e}") from None
    require(n > 0, "run.cv_data", f"no usable utterance in {path}" +
            (f" ({stats.summary('its lines')})" if stats.skipped else " (empty list)"))


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
