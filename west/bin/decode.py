"""``west-decode --checkpoint DIR --data LIST --result OUT.jsonl``: batched greedy / beam search.

Argument parsing and checks only for now; decoding is assembled with the models
(issue 4): load config.yaml + model.safetensors, run the encoder + projector,
splice the speech embeddings, and call the LLM's ``generate(inputs_embeds=...)``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from west.train.checkpoint import find_latest


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="west-decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint dir (DIR/checkpoints/step_N) or a run DIR (its latest checkpoint)")
    p.add_argument("--data", required=True, help="data list to decode")
    p.add_argument("--result", required=True, help="output jsonl: {key, text} per utterance")
    p.add_argument("--config", help="config.yaml (default: the run dir's config.yaml)")
    p.add_argument("--beam_size", type=int, default=1, help="1 = greedy")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--ref", help="reference transcripts: print CER/WER after decoding")
    return p


def resolve_checkpoint(path: str) -> Path:
    """A step dir as given, or the latest checkpoint of a run dir."""
    p = Path(path)
    if (p / "meta.json").is_file():
        return p
    latest = find_latest(p / "checkpoints")
    if latest is None:
        raise FileNotFoundError(f"--checkpoint {path}: neither a checkpoint nor a run dir with one")
    return latest


def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        if args.beam_size < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
            raise ValueError("--beam_size, --batch_size and --max_new_tokens must be >= 1")
        ckpt = resolve_checkpoint(args.checkpoint)
        if not Path(args.data).exists():
            raise FileNotFoundError(f"--data: no such file: {args.data}")
    except (OSError, ValueError) as e:
        print(f"west-decode: error: {e}", file=sys.stderr)
        return 2
    print(f"west-decode: would decode {args.data} with {ckpt}; decoding is wired in with the "
          "models (issue 4)", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
