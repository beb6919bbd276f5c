#!/usr/bin/env python3
"""Score a decoding: ``python tools/compute_cer.py REF HYP [--mode auto|cer|wer] [--normalizer NAME] [--per_utt]``.

REF and HYP are Kaldi-style ``key text`` files or jsonl with ``key`` and ``text``
(or ``txt``/``hyp``). Chinese is scored by characters (spaces removed), space-
separated text by words; ``auto`` decides from the references. Both sides go
through ``--normalizer`` first (west.infer.scoring: none, english, mandarin,
mandarin_t2s); the files are only read. Prints the total, which names the
normalizer (and, with --per_utt, one line per utterance with errors); exit code 0.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from west.infer.scoring import NORMALIZERS, ErrorRate, score_files


def compute_cer(ref: str, hyp: str, mode: str = "auto", normalizer: str = "none") -> dict:
    """Numbers for reuse: {mode, normalizer, rate, errors, ref_tokens, utts, missing, extra}."""
    return figures(score_files(ref, hyp, mode, normalizer))


def figures(r: ErrorRate) -> dict:
    return {"mode": r.mode, "normalizer": r.normalizer, "rate": r.rate, "errors": r.errors,
            "ref_tokens": r.ref_tokens, "utts": r.utts, "missing": len(r.missing), "extra": len(r.extra)}


def _print(r: ErrorRate, per_utt: bool) -> None:
    if per_utt:
        for key, (e, n) in r.per_utt.items():
            if e:
                print(f"{key}\t{e}/{n}")
    print(r.summary())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ref")
    p.add_argument("hyp")
    p.add_argument("--mode", choices=["auto", "cer", "wer"], default="auto")
    p.add_argument("--normalizer", choices=list(NORMALIZERS), default="none",
                   help="text normalization of both sides before scoring [none]")
    p.add_argument("--per_utt", action="store_true", help="list utterances with errors")
    p.add_argument("--json", help="also write the totals as JSON to this file")
    args = p.parse_args(argv)
    try:
        r = score_files(args.ref, args.hyp, args.mode, args.normalizer)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print(r, args.per_utt)
    if args.json:
        Path(args.json).write_text(json.dumps(figures(r)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
