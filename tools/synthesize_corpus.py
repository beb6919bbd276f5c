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
    audio_stats,
    draw_speaker,
    draw_utterance,
    prepare_root,
    render_all,
    render_files,
    same_options,
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


def already_synthesized(args: argparse.Namespace) -> bool:
    """OUT/data_aishell holds a complete corpus made with these options (so the recipe
    can reuse it); raises OSError / ValueError when there is no readable marker."""
    return same_options(Path(args.out) / "data_aishell", vars(args))


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="writes OUT/data_aishell/")
    p.add_argument("--num_train", type=int, default=1500, help="train utterances")
    p.add_argument("--num_dev", type=int, default=100, help="dev utterances")
    p.add_argument("--num_test", type=int, default=100, help="test utterances")
    p.add_argument("--num_speakers", type=int, default=40,
                   help="speakers in all; train/dev/test get disjoint ones")
    p.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    p.add_argument("--vocab_size", type=int, default=300, help="most frequent words used")
    p.add_argument("--mean_duration", type=float, default=4.5,
                   help="mean utterance seconds (lognormal target)")
    p.add_argument("--dict", default=None,
                   help="jieba-format 'word freq [tag]' file; unset = jieba's dict.txt")
    p.add_argument("--num_workers", type=int, default=2, help="worker processes")
    p.add_argument("--force", action="store_true", help="replace an earlier synthesized corpus")
    p.add_argument("--check", action="store_true",
                   help="synthesize nothing: print True when OUT already holds a complete corpus made "
                        "with these options, else False (fails when OUT has none)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = get_parser().parse_args(argv)
    if args.check:
        same = already_synthesized(args)
        print(same)
        return {"same": same}
    for name in ("num_train", "num_dev", "num_test"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name} must be >= 0")
    if args.num_train + args.num_dev + args.num_test == 0:
        raise SystemExit("nothing to synthesize: all of --num_train/--num_dev/--num_test are 0")
    if args.vocab_size < 1 or args.mean_duration <= 0 or args.num_speakers < 1:
        raise SystemExit("--vocab_size, --mean_duration and --num_speakers must be positive")
    try:
        stats = synthesize(args)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    u = stats["utterances"]
    print(f"[synthesize_corpus] {sum(u.values())} utterances (train {u['train']} / dev {u['dev']}"
          f" / test {u['test']}), {stats['hours']:.2f} h, mean {stats['mean_s']:.2f} s "
          f"(min {stats['min_s']:.2f}, max {stats['max_s']:.2f}), vocab {stats['vocab_words']} "
          f"words, {stats['wall_s']:.1f} s wall = {stats['audio_s_per_wall_s']:.0f}x real time "
          f"-> {Path(args.out) / 'data_aishell'}")
    return stats


if __name__ == "__main__":
    main()
