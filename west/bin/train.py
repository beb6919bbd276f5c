"""``west-train`` / ``torchrun --nproc_per_node N -m west.bin.train``: parse, check, train.

Everything that can be wrong with the command line or the paths is reported
here, before any data is read (exit code 2, message naming the key).
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

from west.train.cli import check_paths, parse_cli, save_config
from west.train.config import Config, ConfigError


def prepare(argv: Sequence[str] | None = None) -> Config:
    """Parse + validate + check paths; rank 0 writes DIR/config.yaml."""
    cfg = parse_cli(argv)
    check_paths(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        save_config(cfg, cfg.run.output_dir)
    return cfg


def run(cfg: Config) -> int:
    """Build data + model and train. Assembled once west.data (issue 3) and west.models
    (issue 4) land: register their section schemas with
    ``west.train.config.register_section("data"/"model", ...)`` before ``prepare``, then
    init_distributed -> build model -> build this rank's data + dummy_batch -> Trainer.fit()."""
    print("west-train: config checked and saved; the data pipeline and models are not wired in "
          "yet (issues 3 and 4)", file=sys.stderr)
    return 3


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = prepare(argv)
    except ConfigError as e:
        print(f"west-train: error: {e}", file=sys.stderr)
        return 2
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
