"""``west-train`` / ``torchrun --nproc_per_node N -m west.bin.train``: parse, check, train.

Everything that can be wrong with the command line or the paths is reported
here, before any data is read (exit code 2, message naming the key).

Exit codes: 0 done; 1 a checkpoint could not be loaded or saved, a log could not be written
(disk full), or too many non-finite steps; 2 bad command line, config or paths; 75 (``PREEMPTED_EXIT_CODE``)
stopped by a preemption signal after a checkpoint: run the same command to resume.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Sequence

from west.config import Config, ConfigError, load_config, split_overrides
from west.ranks import cuda_allocator_defaults
from west.train.config import TrainConfig
from west.train.preempt import PREEMPTED_EXIT_CODE
from west.train.rundir import check_paths, save_config

FLAGS = {  # west-train's top-level flags: the key each one sets, and its help
    "train_data": ("run.train_data", "data list(s) (jsonl / kaldi-style / shard list), comma-separated for several"),
    "cv_data": ("run.cv_data", "dev list evaluated during training (loss; CER with train.eval_decode_utts)"),
    "output_dir": ("run.output_dir", "run directory: checkpoints, logs, config.yaml"),
    "batch_type": ("data.batch_type", "static | dynamic | pack (west.data.policies)"),
    "batch_size": ("data.batch_size", "static: utterances per batch"),
    "max_tokens_in_batch": ("data.max_tokens_in_batch", "dynamic: padded LLM tokens per batch"),
    "pack_tokens": ("data.pack_tokens", "pack: LLM tokens per packed row"),
    "max_steps": ("train.max_steps", "optimizer steps (0 = use train.max_epochs)"),
    "seed": ("train.seed", "random seed"),
    "resume": ("run.resume", "auto (default: resume if DIR has one), never, must (bare --resume) or a checkpoint dir"),
    "audit": ("run.audit", "write DIR/audit/rank{R}.jsonl with the utterance keys of every step"),
}


def build_arg_parser(prog: str = "west-train") -> argparse.ArgumentParser:
    sections = [f.name for f in dataclasses.fields(Config)]
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a speech LLM. Any config key can be overridden as --section.key VALUE "
                    "(typed like the key); see docs/training.md.",
        epilog=f"sections: {', '.join(sections)}\ntrain keys: "
               f"{', '.join(f.name for f in dataclasses.fields(TrainConfig))}")
    p.add_argument("--config", help=f"YAML file with sections {'/'.join(sections)}")
    extra = {"resume": dict(nargs="?", const="must"), "audit": dict(action="store_const", const="true")}
    for flag, (key, text) in FLAGS.items():
        p.add_argument(f"--{flag}", help=f"{text} [{key}]", **extra.get(flag, {}))
    return p


def parse_train_args(argv: Sequence[str] | None = None, prog: str = "west-train") -> Config:
    """west-train's command line -> validated Config (no file besides --config is read)."""
    args, rest = build_arg_parser(prog).parse_known_args(argv)
    flags = [(FLAGS[k][0], v) for k, v in vars(args).items() if k in FLAGS and v is not None]
    return load_config(args.config, flags + split_overrides(rest))  # --section.key wins over flags



def prepare(argv: Sequence[str] | None = None) -> Config:
    """Parse + validate + check paths; rank 0 writes DIR/config.yaml."""
    cfg = parse_train_args(argv)
    check_paths(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        save_config(cfg, cfg.run.output_dir)
    return cfg


def run(cfg: Config, observers: Sequence = ()) -> int:
    """Build tokenizer, model and this rank's data, then train (west.train.build); ``observers``
    watch every step (west.train.loop.StepObserver; none in a plain run)."""
    from west.checkpoint.training import CheckpointError  # heavy
    from west.train.build import train  # heavy
    from west.train.log_writes import LogWriteError  # heavy
    from west.train.metrics import done_sentence  # heavy
    from west.train.step import TooManyBadSteps  # heavy

    try:
        summary = train(cfg, observers)
    except ConfigError as e:   # found while building (e.g. a dev list with no usable utterance)
        print(f"west-train: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, LogWriteError, TooManyBadSteps) as e:
        print(f"west-train: error: {e}", file=sys.stderr)
        return 1
    main_rank = int(os.environ.get("RANK", "0")) == 0
    if summary.get("preempted"):
        if main_rank:
            print(f"west-train: preempted ({summary['preempted']}) after step {summary['step']:,}; checkpoint "
                  f"{summary['checkpoint']}; run the same command to resume (exit status {PREEMPTED_EXIT_CODE})",
                  flush=True)
        return PREEMPTED_EXIT_CODE
    if main_rank:
        print(f"west-train: {done_sentence(summary)}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None, observers: Sequence = ()) -> int:
    cuda_allocator_defaults()
    try:
        cfg = prepare(argv)
    except ConfigError as e:
        print(f"west-train: error: {e}", file=sys.stderr)
        return 2
    return run(cfg, observers)


if __name__ == "__main__":
    sys.exit(main())
