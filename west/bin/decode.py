"""``west-decode --checkpoint DIR --data LIST --result OUT.jsonl``: batched greedy / beam search.

Loads a training checkpoint (with the run's config.yaml) or a save_pretrained
export, builds prompt-only inputs through the data pipeline, generates with the
LLM's ``generate(inputs_embeds=...)`` and writes one ``{key, hyp, ref}`` line per
utterance (the raw texts); prints CER/WER against the list's transcripts (or ``--ref``)
after ``--normalizer`` (default: the run's ``train.eval_normalizer``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="west-decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint dir (DIR/checkpoints/step_N), a run DIR (its latest checkpoint) "
                        "or a SpeechLLM.save_pretrained export")
    p.add_argument("--data", required=True, help="data list to decode (any format west-train reads)")
    p.add_argument("--result", required=True, help="output jsonl: {key, hyp, ref} per utterance")
    p.add_argument("--config", help="the run's config.yaml (default: found next to the checkpoint)")
    p.add_argument("--llm_path", help="the base LLM dir, if it moved since training (default: the run's "
                                      "model.llm.path; its files must be the ones the checkpoint was trained on)")
    p.add_argument("--beam_size", type=int, default=1, help="1 = greedy")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--ref", help="reference transcripts to score against (default: the list's own)")
    p.add_argument("--normalizer", help="text normalizer applied to both sides before scoring: none, english, "
                                        "mandarin, mandarin_t2s (default: the run's train.eval_normalizer, else none)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def resolve_checkpoint(path: str) -> Path:
    """See west.checkpoint.restore.resolve_checkpoint (imported lazily: ``--help`` stays fast)."""
    from west.checkpoint.restore import resolve_checkpoint as resolve  # heavy

    return resolve(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        if args.beam_size < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
            raise ValueError("--beam_size, --batch_size and --max_new_tokens must be >= 1")
        resolve_checkpoint(args.checkpoint)
        if not Path(args.data).exists():
            raise FileNotFoundError(f"--data: no such file: {args.data}")
        if args.ref and not Path(args.ref).is_file():
            raise FileNotFoundError(f"--ref: no such file: {args.ref}")
        from west.config import ConfigError  # heavy
        from west.train.rundir import prepare_output_dir  # heavy

        try:
            prepare_output_dir(Path(args.result).resolve().parent)
        except ConfigError as e:
            raise OSError(str(e).replace("run.output_dir", "--result")) from None
        from west.infer.load import load_for_decoding, run_normalizer  # heavy
        from west.infer.scoring import get_normalizer  # light, but only past the cheap checks

        normalizer = args.normalizer or run_normalizer(args.checkpoint, args.config)
        try:
            get_normalizer(normalizer)
        except ValueError as e:
            raise ValueError(f"--normalizer: {e}") from None
        model, tokenizer, conf = load_for_decoding(args.checkpoint, args.config, args.device, args.llm_path)
    except (OSError, ValueError) as e:
        print(f"west-decode: error: {e}", file=sys.stderr)
        return 2
    from west.infer.decode import decode_list  # heavy

    s = decode_list(model, tokenizer, conf, args.data, args.result, beam_size=args.beam_size,
                    batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, ref=args.ref,
                    progress=not args.quiet, normalizer=normalizer)
    skipped = f", skipped {s.skipped}" if s.skipped else ""
    print(f"west-decode: {s.utterances} utterances in {s.seconds:.1f} s{skipped} -> {s.result}")
    if s.score is not None:
        print(s.score.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
