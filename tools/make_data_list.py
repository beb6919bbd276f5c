#!/usr/bin/env python3
"""Kaldi-style data dir (wav.scp + text [+ segments] [+ utt2dur]) -> west jsonl list.

One line per utterance: {"key", "wav", "txt", "duration"[, "start", "end"]}.
Durations come from utt2dur, from segments (end - start) or, with
--compute_duration, from the audio header. Utterances without a transcript or
audio are reported and left out (the count is printed).

    python tools/make_data_list.py --wav_scp data/train/wav.scp --text data/train/text \
        [--segments data/train/segments] [--compute_duration] data/train/data.list
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import soundfile as sf  # noqa: E402


def read_table(path: str) -> dict[str, str]:
    out = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.strip().split(maxsplit=1)
            if not parts:
                continue
            if len(parts) == 1:
                parts.append("")
            out[parts[0]] = parts[1]
    return out


def build_rows(wav_scp: str, text: str, segments: str | None = None, utt2dur: str | None = None,
               compute_duration: bool = False, keep_paths: bool = False) -> tuple[list[dict], list[str]]:
    """(rows, problems): rows in wav.scp / segments order."""
    wavs, texts = read_table(wav_scp), read_table(text)
    durs = {k: float(v) for k, v in read_table(utt2dur).items()} if utt2dur else {}
    rows, problems = [], []
    if segments:
        utts = []
        for key, rest in read_table(segments).items():
            rec, start, end = rest.split()
            utts.append((key, rec, float(start), float(end)))
    else:
        utts = [(key, key, None, None) for key in wavs]
    for key, rec, start, end in utts:
        if rec not in wavs:
            problems.append(f"{key}: recording {rec} not in {wav_scp}")
            continue
        path = wavs[rec]
        if path.endswith("|"):
            problems.append(f"{key}: piped wav.scp entries are not supported ({path})")
            continue
        if not texts.get(key, "").strip():
            problems.append(f"{key}: no transcript in {text}")
            continue
        row = {"key": key, "wav": path if keep_paths else os.path.abspath(path), "txt": texts[key]}
        if start is not None:
            row.update(start=start, end=end, duration=round(end - start, 4))
        elif key in durs:
            row["duration"] = durs[key]
        elif compute_duration:
            try:
                info = sf.info(path)
                row["duration"] = round(info.frames / info.samplerate, 4)
            except Exception as e:  # unreadable audio stays in the list; the loader skips and counts it
                problems.append(f"{key}: cannot read header of {path}: {e}")
        rows.append(row)
    return rows, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wav_scp", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--segments")
    p.add_argument("--utt2dur")
    p.add_argument("--compute_duration", action="store_true", help="read durations from audio headers")
    p.add_argument("--keep_paths", action="store_true", help="write wav paths as given (default: absolute)")
    p.add_argument("out")
    a = p.parse_args(argv)
    rows, problems = build_rows(a.wav_scp, a.text, a.segments, a.utt2dur, a.compute_duration, a.keep_paths)
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    for msg in problems[:20]:
        print(f"warning: {msg}", file=sys.stderr)
    print(f"wrote {len(rows)} utterances to {a.out}; {len(problems)} problem(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
