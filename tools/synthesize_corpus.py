#!/usr/bin/env python3
"""Synthesize a small AIShell-1-shaped Mandarin corpus with eSpeak NG, fully offline.

Why: the recipe must run end to end on a fresh offline CPU machine. This writes
``OUT/data_aishell/`` with the same layout as AIShell-1 (wav/{train,dev,test}/SXXXX/
BAC009SXXXXWYYYY.wav, 16 kHz 16-bit mono, and transcript/aishell_transcript_v0.8.txt with
space-separated words), so the recipe's stages run on it unchanged.

Text: random sequences of the ``--vocab_size`` most frequent multi-character Chinese words
of jieba's dict.txt; the number of words follows a lognormal target duration (mean
``--mean_duration``). Speakers: eSpeak NG voice variants with their own speaking rate,
pitch, pitch range, gain and noise floor; dev/test speakers are disjoint from train ones,
as in AIShell.

Determinism: the whole plan (speakers, words, silences, seeds) is drawn from ``--seed`` in
the parent. libespeak-ng keeps state across utterances that espeak_Terminate does not reset
(lengths drift by a few ms) and some voices draw from libc rand(), so each speaker is
rendered in a fresh worker process (``maxtasksperchild=1``) and rand() is seeded per
utterance: the output is byte-identical for a seed whatever ``--num_workers`` is.
"""
from __future__ import annotations

import argparse
import importlib.resources
import json
import re
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from espeak_corpus import (
    MARKER,
    SPLITS,
    Speaker,
    Utterance,
    add_corpus_options,
    audio_stats,
    draw_speaker,
    draw_utterance,
    prepare_root,
    render_all,
    render_files,
    run_cli,
    speakers_per_split,
)

PREFIX = "BAC009"  # AIShell-1's recording-session prefix of every utterance id
FIRST_SPEAKER = 2  # AIShell-1's speaker ids start at S0002
TRANSCRIPT = "transcript/aishell_transcript_v0.8.txt"
VOICE = "cmn"
VARIANTS = ("", "f1", "f2", "f3", "f4", "f5", "m1", "m2", "m3", "m4", "m5", "m6", "m7")
# eSpeak's speaking time ~ OFFSET + chars * SEC_PER_CHAR at rate 175, scaled by
# (175 / rate) ** RATE_EXPONENT: fitted on 225 random sentences over 5 voices and rates
# 140/175/220 (residual ~7 %). Only used to choose how many words reach a target duration.
SPEECH_OFFSET_S = 0.15
SEC_PER_CHAR_175 = 0.249
RATE_EXPONENT = 1.1
HAN_WORD = re.compile(r"^[\u4e00-\u9fff]{2,}$")


def load_vocab(size: int, dict_path: str | None = None) -> list[str]:
    """The ``size`` most frequent multi-character all-Han words of a jieba-format dict."""
    if dict_path is None:
        source = importlib.resources.files("jieba").joinpath("dict.txt")
    else:
        source = Path(dict_path)
    entries = []
    with source.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) < 2 or not parts[1].isdigit():
                raise ValueError(f"{source}:{lineno}: expected 'word freq [tag]', got {line!r}")
            if HAN_WORD.match(parts[0]):
                entries.append((-int(parts[1]), parts[0]))
    entries.sort()
    if len(entries) < size:
        raise ValueError(f"{source} has only {len(entries)} multi-character words, asked {size}")
    return [word for _, word in entries[:size]]


def speech_seconds(n_chars: int, rate: int) -> float:
    """Estimated eSpeak speaking time of ``n_chars`` Han characters at ``rate``."""
    if n_chars == 0:
        return 0.0
    return (SPEECH_OFFSET_S + n_chars * SEC_PER_CHAR_175) * (175.0 / rate) ** RATE_EXPONENT


def plan_corpus(counts: dict[str, int], num_speakers: int, vocab: list[str], seed: int,
                mean_duration: float = 4.5) -> list[tuple[Speaker, list[Utterance]]]:
    """Every random choice of the corpus, drawn in a fixed order from ``seed``."""
    rng = np.random.default_rng(seed)
    n_spk = speakers_per_split(counts, num_speakers)
    plan, next_id = [], FIRST_SPEAKER
    for split in SPLITS:
        for k in range(n_spk[split]):
            spk = draw_speaker(rng, f"S{next_id:04d}", split, VARIANTS, VOICE)
            next_id += 1
            n_utt = counts[split] // n_spk[split] + (k < counts[split] % n_spk[split])

            def seconds(words: list[str], rate: int = spk.rate) -> float:
                return speech_seconds(sum(map(len, words)), rate)

            utts = [draw_utterance(rng, f"{PREFIX}{spk.sid}W{w + 1:04d}", vocab, mean_duration, seconds)
                    for w in range(n_utt)]
            plan.append((spk, utts))
    return plan


def render_speaker(job: tuple[str, Speaker, list[Utterance]]) -> list[tuple[str, float]]:
    """Worker: render one speaker's utterances in order to wav/SPLIT/SPEAKER/UTTID.wav under the
    root; returns (uid, seconds) per file."""
    root, spk, utts = job
    spk_dir = Path(root) / "wav" / spk.split / spk.sid
    return render_files(spk, [(u, "".join(u.words), spk_dir / f"{u.uid}.wav") for u in utts])


def synthesize(args: argparse.Namespace) -> dict:
    """Plan, render in worker processes, write the transcript; returns summary statistics."""
    counts = {"train": args.num_train, "dev": args.num_dev, "test": args.num_test}
    vocab = load_vocab(args.vocab_size, args.dict)
    plan = plan_corpus(counts, args.num_speakers, vocab, args.seed, args.mean_duration)
    root = Path(args.out) / "data_aishell"
    prepare_root(root, args.force)
    # written first so that --force may clean up after an interrupted run
    (root / MARKER).write_text(json.dumps({"complete": False, "args": vars(args)}))
    jobs = sorted(((str(root), spk, utts) for spk, utts in plan if utts),
                  key=lambda job: -len(job[2]))
    start = time.perf_counter()
    # A fresh process per speaker: see tools/espeak_corpus.py (eSpeak state, determinism).
    durations = render_all(render_speaker, jobs, args.num_workers, sum(counts.values()))
    wall = time.perf_counter() - start

    lines = sorted(f"{u.uid} {' '.join(u.words)}" for _, utts in plan for u in utts)
    (root / TRANSCRIPT).parent.mkdir(parents=True, exist_ok=True)
    (root / TRANSCRIPT).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    stats = {
        "utterances": {s: counts[s] for s in SPLITS},
        "speakers": {s: sum(1 for spk, u in plan if spk.split == s and u) for s in SPLITS},
        "vocab_words": len(vocab), "vocab_chars": len(set("".join(vocab))),
        **audio_stats(durations, wall, args.num_workers),
    }
    meta = {"complete": True, "args": vars(args), "stats": stats, "speakers": [asdict(s) for s, _ in plan]}
    (root / MARKER).write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")
    return stats


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="writes OUT/data_aishell/")
    add_corpus_options(p, {"train": "train", "dev": "dev", "test": "test"})
    p.add_argument("--vocab_size", type=int, default=300, help="most frequent words used")
    p.add_argument("--dict", default=None,
                   help="jieba-format 'word freq [tag]' file; unset = jieba's dict.txt")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.vocab_size < 1:
        raise SystemExit("--vocab_size must be positive")


def main(argv: list[str] | None = None) -> dict:
    return run_cli("synthesize_corpus", get_parser().parse_args(argv), "data_aishell", synthesize, _check)


if __name__ == "__main__":
    main()
