#!/usr/bin/env python3
"""Recipe stage 4: a tiny tokenizer + random Qwen2 built from the train transcripts, then (with
STEPS > 0) pretrained on them, text only, as the stand-in for a pretrained LLM.

    python tools/make_tiny_llm.py data/train/text exp/tiny_llm VOCAB_SIZE STEPS --config conf/tiny_cpu.yaml

TEXT may name several Kaldi text files, comma-separated (several train subsets). The pretraining streams match what the training config's projector will send: compact
streams (tokens first, blanks after) for ``ctc_compact``, CTC-like ones otherwise.
"""
from __future__ import annotations

import argparse

from west.config import merge
from west.models.tiny_llm import build_tiny_llm, pretrain_transcriber

PROMPT = "Transcribe the speech."  # the recipe's prompt: its characters need tokens too


def read_texts(paths: str) -> list[str]:
    """Transcripts of comma-separated Kaldi ``text`` files; keys without text are left out."""
    texts = []
    for path in paths.split(","):
        with open(path, encoding="utf-8") as f:
            texts += [p[1] for p in (line.rstrip("\n").split(maxsplit=1) for line in f) if len(p) == 2]
    return texts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("text", help="Kaldi text file(s) (key transcript), comma-separated")
    p.add_argument("out", help="LLM dir to write (tokenizer + weights)")
    p.add_argument("vocab_size", type=int)
    p.add_argument("steps", type=int, help="text-only pretraining steps, 0 = keep it random")
    p.add_argument("--config", help="the west-train config: its model.projector.type picks the stream style")
    a = p.parse_args(argv)
    projector = (merge(a.config).get("model", {}).get("projector") or {}).get("type") if a.config else None
    texts = read_texts(a.text)
    build_tiny_llm(texts + [PROMPT], a.out, vocab_size=a.vocab_size)
    if a.steps > 0:
        r = pretrain_transcriber(a.out, texts, steps=a.steps, compact=projector == "ctc_compact")
        style = "compact" if projector == "ctc_compact" else "CTC-like"
        print(f"[run.sh] tiny LLM pretraining on {style} streams: answer loss {r['first_loss']:.2f} -> {r['loss']:.2f}, "
              f"token accuracy {r['first_acc']:.1%} -> {r['acc']:.1%}")


if __name__ == "__main__":
    main()
