#!/usr/bin/env python3
"""Synthesize a small English corpus in LibriSpeech's layout with eSpeak NG, fully offline.

Why: the LibriSpeech recipe must run end to end on a fresh offline CPU machine, where the
real corpus (60 GB) cannot be downloaded. This writes ``OUT/LibriSpeech/`` as LibriSpeech
lays it out, so the recipe's stages run on it unchanged:

    LibriSpeech/train-clean-100/SPEAKER/CHAPTER/SPEAKER-CHAPTER-NNNN.flac   16 kHz 16-bit mono
    LibriSpeech/train-clean-100/SPEAKER/CHAPTER/SPEAKER-CHAPTER.trans.txt   "ID WORDS IN CAPITALS"
    LibriSpeech/dev-clean/...  LibriSpeech/test-clean/...  SPEAKERS.TXT  synthesis.json

Text: random sequences of the first ``--vocab_size`` words of WORDS (English content words
without homophones among them, so that the audio decides each word); the number of words
follows a lognormal target duration (mean ``--mean_duration``). Speakers: eSpeak NG's
English voices (American, British, Scottish, received pronunciation, Caribbean, Lancashire,
West Midlands, New York) with a voice variant, speaking rate, pitch, pitch range, gain and
noise floor each; dev/test speakers are disjoint from train ones, as in LibriSpeech. Each
speaker reads ``--chapters_per_speaker`` chapters.

Determinism and the engine: tools/espeak_corpus.py (shared with the Mandarin corpus); the
output is byte-identical for a seed whatever ``--num_workers`` is.
"""
from __future__ import annotations

import argparse
import json
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

SUBSETS = {"train": "train-clean-100", "dev": "dev-clean", "test": "test-clean"}
FIRST_SPEAKER = 100  # speaker ids are plain integers, as in LibriSpeech
FIRST_CHAPTER = 1000
VOICES = ("en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbclan",
          "en-gb-x-gbcwmd", "en-us-nyc")
VARIANTS = ("", "f1", "f2", "f3", "f4", "f5", "m1", "m2", "m3", "m4", "m5", "m6", "m7")
# eSpeak's English speaking time ~ OFFSET + words * SEC_PER_WORD + letters * SEC_PER_LETTER at
# rate 175, scaled by (175 / rate) ** RATE_EXPONENT: fitted on 240 random sentences of WORDS
# over the voices above and rates 140/175/220 (residual ~6 %). Only used to choose how many
# words reach a target duration.
SPEECH_OFFSET_S = 0.098
SEC_PER_WORD_175 = 0.144
SEC_PER_LETTER_175 = 0.0355
RATE_EXPONENT = 1.0
# Content words, no two of which sound alike (no right/write, hour/our, ...), in a fixed order:
# --vocab_size N takes the first N.
WORDS = (
    "water garden morning people family story river mountain window doctor teacher student market "
    "village forest island animal yellow purple orange silver happy quiet gentle simple strong little "
    "evening winter summer music paper pencil letter picture kitchen table chair bottle basket bridge "
    "castle engine factory station hospital library office planet ocean valley desert harbor machine "
    "computer language question answer problem reason moment history science nature weather journey "
    "dinner breakfast chicken apple lemon butter cheese coffee sugar bread honey carrot potato tomato "
    "pepper rabbit tiger monkey horse turtle spider dragon wizard captain soldier farmer builder painter "
    "singer dancer driver pilot brother sister mother father daughter cousin neighbor stranger friendly "
    "careful famous modern ancient heavy narrow broken hidden secret public central northern southern "
    "western eastern bright dark cold warm green black white brown small large fast slow open begin "
    "finish follow carry remember forget listen notice wonder explain promise imagine discover believe "
    "decide gather deliver protect support arrive return visit wander whisper shout laugh smile dream "
    "build climb swim jump dance paint sing speak think learn teach watch walk sleep"
).split()


def speech_seconds(words: list[str], rate: int) -> float:
    """Estimated eSpeak speaking time of ``words`` at ``rate``."""
    if not words:
        return 0.0
    letters = sum(map(len, words))
    return (SPEECH_OFFSET_S + len(words) * SEC_PER_WORD_175 + letters * SEC_PER_LETTER_175) \
        * (175.0 / rate) ** RATE_EXPONENT


def plan_corpus(counts: dict[str, int], num_speakers: int, vocab: list[str], seed: int,
                mean_duration: float = 4.5, chapters_per_speaker: int = 2
                ) -> list[tuple[Speaker, list[tuple[str, list[Utterance]]]]]:
    """Every random choice of the corpus, drawn in a fixed order from ``seed``: per speaker,
    its chapters and their utterances (ids SPEAKER-CHAPTER-NNNN)."""
    rng = np.random.default_rng(seed)
    n_spk = speakers_per_split(counts, num_speakers)
    plan, next_id, next_chapter = [], FIRST_SPEAKER, FIRST_CHAPTER
    for split in SPLITS:
        for k in range(n_spk[split]):
            voice = VOICES[int(rng.integers(len(VOICES)))]
            spk = draw_speaker(rng, str(next_id), split, VARIANTS, voice)
            next_id += 1
            n_utt = counts[split] // n_spk[split] + (k < counts[split] % n_spk[split])

            def seconds(words: list[str], rate: int = spk.rate) -> float:
                return speech_seconds(words, rate)

            chapters = []
            n_chap = max(1, min(chapters_per_speaker, n_utt))
            for c in range(n_chap):
                chapter = str(next_chapter)
                next_chapter += 1
                n = n_utt // n_chap + (c < n_utt % n_chap)
                chapters.append((chapter, [draw_utterance(rng, f"{spk.sid}-{chapter}-{i:04d}", vocab,
                                                          mean_duration, seconds) for i in range(n)]))
            plan.append((spk, chapters))
    return plan


def chapter_dir(root: Path, spk: Speaker, chapter: str) -> Path:
    return root / SUBSETS[spk.split] / spk.sid / chapter


def render_speaker(job: tuple[str, Speaker, list[tuple[str, list[Utterance]]]]) -> list[tuple[str, float]]:
    """Worker: one speaker's chapters as FLAC files and their .trans.txt under the root."""
    root, spk, chapters = job
    items = []
    for chapter, utts in chapters:
        d = chapter_dir(Path(root), spk, chapter)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{spk.sid}-{chapter}.trans.txt").write_text(
            "".join(f"{u.uid} {' '.join(u.words).upper()}\n" for u in utts), encoding="utf-8")
        items += [(u, " ".join(u.words), d / f"{u.uid}.flac") for u in utts]
    return render_files(spk, items)


def speakers_txt(plan: list) -> str:
    """SPEAKERS.TXT in LibriSpeech's format (ID | SEX | SUBSET | MINUTES | NAME)."""
    lines = [";ID  |SEX| SUBSET           |MINUTES| NAME"]
    for spk, _ in plan:
        sex = "F" if spk.variant.startswith("f") else "M"
        lines.append(f"{spk.sid:<5}| {sex} | {SUBSETS[spk.split]:<17}| {0:5.2f} | eSpeak NG {spk.voice_name}")
    return "\n".join(lines) + "\n"


def synthesize(args: argparse.Namespace) -> dict:
    """Plan, render in worker processes; returns summary statistics."""
    counts = {"train": args.num_train, "dev": args.num_dev, "test": args.num_test}
    vocab = WORDS[:args.vocab_size]
    plan = plan_corpus(counts, args.num_speakers, vocab, args.seed, args.mean_duration,
                       args.chapters_per_speaker)
    root = Path(args.out) / "LibriSpeech"
    prepare_root(root, args.force)
    # written first so that --force may clean up after an interrupted run
    (root / MARKER).write_text(json.dumps({"complete": False, "args": vars(args)}))
    jobs = sorted(((str(root), spk, chapters) for spk, chapters in plan if chapters),
                  key=lambda job: -sum(len(u) for _, u in job[2]))
    start = time.perf_counter()
    durations = render_all(render_speaker, jobs, args.num_workers, sum(counts.values()))
    wall = time.perf_counter() - start
    (root / "SPEAKERS.TXT").write_text(speakers_txt(plan), encoding="utf-8")
    stats = {
        "utterances": {SUBSETS[s]: counts[s] for s in SPLITS},
        "speakers": {SUBSETS[s]: sum(1 for spk, _ in plan if spk.split == s) for s in SPLITS},
        "vocab_words": len(vocab), **audio_stats(durations, wall, args.num_workers),
    }
    meta = {"complete": True, "args": vars(args), "stats": stats, "speakers": [asdict(s) for s, _ in plan]}
    (root / MARKER).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return stats


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="writes OUT/LibriSpeech/")
    add_corpus_options(p, SUBSETS)
    p.add_argument("--chapters_per_speaker", type=int, default=2)
    p.add_argument("--vocab_size", type=int, default=len(WORDS),
                   help=f"the first N of the tool's {len(WORDS)} words")
    return p


def _check(args: argparse.Namespace) -> None:
    if not 1 <= args.vocab_size <= len(WORDS):
        raise SystemExit(f"--vocab_size must be in 1..{len(WORDS)}")
    if args.chapters_per_speaker < 1:
        raise SystemExit("--chapters_per_speaker must be positive")


def main(argv: list[str] | None = None) -> dict:
    return run_cli("synthesize_librispeech", get_parser().parse_args(argv), "LibriSpeech", synthesize, _check)


if __name__ == "__main__":
    main()
