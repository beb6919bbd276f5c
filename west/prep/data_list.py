"""Kaldi-style data dir (wav.scp + text [+ segments] [+ utt2dur]) -> west jsonl list.

One line per utterance: {"key", "wav", "txt", "duration"[, "start", "end"]}.
Durations come from utt2dur, from segments (end - start) or, with
``compute_duration``, from the audio header. Utterances without a transcript or
audio are reported and left out (the count is printed): the one writer of the list
format, used by tools/make_data_list.py and tools/prepare_aishell.py.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, TextIO

import soundfile as sf


def read_table(path: str) -> dict[str, str]:
    """``key rest-of-line`` per line (Kaldi tables); a key alone maps to ""."""
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


def write_data_list(out: str, wav_scp: str, text: str, segments: str | None = None,
                    utt2dur: str | None = None, compute_duration: bool = False, keep_paths: bool = False,
                    log: Optional[TextIO] = None) -> tuple[list[dict], list[str]]:
    """Build the rows, write them to ``out`` and report the problems (the first 20) and the
    count on ``log`` (stderr by default): a left-out utterance is never silent."""
    log = log if log is not None else sys.stderr
    rows, problems = build_rows(wav_scp, text, segments, utt2dur, compute_duration, keep_paths)
    with open(out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    for msg in problems[:20]:
        print(f"warning: {msg}", file=log)
    print(f"wrote {len(rows)} utterances to {out}; {len(problems)} problem(s)", file=log)
    return rows, problems
