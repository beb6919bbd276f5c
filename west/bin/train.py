"""``west-train`` / ``torchrun --nproc_per_node N -m west.bin.train``: parse, check, train.

Everything that can be wrong with the command line or the paths is reported
here, before any data is read (exit code 2, message naming the key).
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

from west.config import Config, ConfigError, check_paths, parse_train_args, save_config


def prepare(argv: Sequence[str] | None = None) -> Config:
    """Parse + validate + check paths; rank 0 writes DIR/config.yaml."""
    cfg = parse_train_args(argv)
    check_paths(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        save_config(cfg, cfg.run.output_dir)
    return cfg


def run(cfg: Config) -> int:
    """Build tokenizer, model and this rank's data, then train (west.train.build)."""
    from west.train.build import train
    from west.train.checkpoint import CheckpointError
    from west.train.step import TooManyBadSteps

    try:
        summary = train(cfg)
    except (CheckpointError, TooManyBadSteps) as e:
        print(f"west-train: error: {e}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"west-train: done: {summary}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = prepare(argv)
    except ConfigError as e:
        print(f"west-train: error: {e}", file=sys.stderr)
        return 2
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
