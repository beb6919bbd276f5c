#!/usr/bin/env python3
"""Kaldi-style lists (wav.scp, text, utt2dur) per split from an AIShell-1 ``data_aishell/`` dir.

Works on the real corpus and on the one tools/synthesize_corpus.py writes (same layout):

    data_aishell/wav/{train,dev,test}/SPEAKER/UTTID.wav
    data_aishell/transcript/aishell_transcript_v0.8.txt     # "UTTID 词 词 词"

Like WeNet's AIShell recipe, the text keeps the transcript with its word spaces removed
(Mandarin is modelled per character). Files are sorted by utterance id, wav paths absolute.
Utterances without a transcript line are skipped and counted; with durations on (the
default), so are audio files whose header cannot be read. ``--jsonl`` also writes
``data.list`` lines ``{"key", "wav", "txt", "duration"}`` with west.prep.data_list (the
writer behind tools/make_data_list.py).

The real corpus ships one archive per speaker (wav/S0002.tar.gz ...); ``--untar`` extracts
them in place first (skipped when already done).
"""
from __future__ import annotations

import argparse
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from west.prep.data_list import write_data_list

SPLITS = ("train", "dev", "test")
TRANSCRIPT = "transcript/aishell_transcript_v0.8.txt"
UNTAR_MARKER = ".untarred"


@dataclass
class SplitReport:
    """What one split produced and what it had to leave out (reported, never silent)."""

    split: str
    written: int = 0
    seconds: float = 0.0
    no_transcript: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    def line(self) -> str:
        hours = f", {self.seconds / 3600:.2f} h" if self.seconds else ""
        return (f"{self.split}: {self.written} utterances{hours}; skipped "
                f"{len(self.no_transcript)} without transcript, {len(self.unreadable)} unreadable")


def read_transcript(path: Path) -> tuple[dict[str, str], int]:
    """uid -> text with spaces removed; also the number of lines that had an id but no text."""
    texts: dict[str, str] = {}
    empty = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            uid = parts[0]
            if uid in texts:
                raise ValueError(f"{path}:{lineno}: duplicate utterance id {uid}")
            if len(parts) == 1:
                empty += 1
                continue
            texts[uid] = "".join(parts[1:])
    return texts, empty


def find_wavs(wav_dir: Path, split: str) -> dict[str, Path]:
    """uid -> absolute path of every wav/{split}/SPEAKER/UTTID.wav."""
    found: dict[str, Path] = {}
    for path in sorted((wav_dir / split).glob("*/*.wav")):
        uid = path.stem
        if uid in found:
            raise ValueError(f"utterance id {uid} appears twice: {found[uid]} and {path}")
        found[uid] = path.absolute()
    return found


def audio_seconds(path: Path) -> float | None:
    """Duration from the file header; None when it cannot be read."""
    import soundfile as sf

    try:
        info = sf.info(str(path))
    except RuntimeError:  # soundfile's LibsndfileError is a RuntimeError
        return None
    if info.samplerate <= 0 or info.frames <= 0:
        return None
    return info.frames / info.samplerate


def untar_speakers(wav_dir: Path) -> int:
    """Extract AIShell-1's per-speaker archives wav/SXXXX.tar.gz into wav/; returns how many."""
    archives = sorted(wav_dir.glob("*.tar.gz"))
    marker = wav_dir / UNTAR_MARKER
    if not archives or marker.exists():
        return 0
    for archive in archives:
        with tarfile.open(archive) as tar:
            tar.extractall(wav_dir, filter="data")  # "data": no absolute paths or links out
    marker.touch()
    return len(archives)


def write_lists(out_dir: Path, rows: list[tuple[str, Path, str, float | None]],
                durations: bool, jsonl: bool) -> None:
    """wav.scp, text, utt2dur (with durations) and optionally data.list."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "wav.scp", "w", encoding="utf-8") as scp, \
            open(out_dir / "text", "w", encoding="utf-8") as text:
        for uid, wav, txt, _ in rows:
            scp.write(f"{uid} {wav}\n")
            text.write(f"{uid} {txt}\n")
    if durations:
        with open(out_dir / "utt2dur", "w", encoding="utf-8") as f:
            for uid, _, _, dur in rows:
                f.write(f"{uid} {dur:.4f}\n")
    else:
        (out_dir / "utt2dur").unlink(missing_ok=True)  # an earlier one would not match wav.scp
    if jsonl:  # one writer of the list format: west.prep.data_list (tools/make_data_list.py)
        write_data_list(str(out_dir / "data.list"), str(out_dir / "wav.scp"), str(out_dir / "text"),
                        utt2dur=str(out_dir / "utt2dur"))


def prepare_split(wav_dir: Path, split: str, texts: dict[str, str], out_dir: Path,
                  durations: bool = True, jsonl: bool = False) -> SplitReport:
    """Write one split's lists; utterances without text or readable audio are counted."""
    report = SplitReport(split)
    rows = []
    for uid, wav in sorted(find_wavs(wav_dir, split).items()):
        if uid not in texts:
            report.no_transcript.append(uid)
            continue
        dur = None
        if durations:
            dur = audio_seconds(wav)
            if dur is None:
                report.unreadable.append(uid)
                continue
            report.seconds += dur
        rows.append((uid, wav, texts[uid], dur))
    write_lists(out_dir / split, rows, durations, jsonl)
    report.written = len(rows)
    return report


def prepare(aishell_dir: str | Path, out_dir: str | Path, splits: tuple[str, ...] = SPLITS,
            durations: bool = True, jsonl: bool = False, untar: bool = False
            ) -> list[SplitReport]:
    """All splits of one data_aishell directory; raises with the path when layout is wrong."""
    root = Path(aishell_dir)
    if not (root / TRANSCRIPT).is_file() and (root / "data_aishell" / TRANSCRIPT).is_file():
        root = root / "data_aishell"  # the folder holding data_aishell/ is accepted too
    wav_dir, transcript = root / "wav", root / TRANSCRIPT
    if not transcript.is_file():
        raise FileNotFoundError(f"{transcript} not found: is {root} a data_aishell directory?")
    if untar:
        n = untar_speakers(wav_dir)
        if n:
            print(f"[prepare_aishell] extracted {n} speaker archives in {wav_dir}")
    missing = [s for s in splits if not (wav_dir / s).is_dir()]
    if missing:
        hint = (" (speaker archives wav/*.tar.gz found: pass --untar)"
                if any(wav_dir.glob("*.tar.gz")) else "")
        raise FileNotFoundError(f"{wav_dir} has no {', '.join(missing)} folder{hint}")
    texts, empty = read_transcript(transcript)
    reports = [prepare_split(wav_dir, s, texts, Path(out_dir), durations, jsonl) for s in splits]
    used = sum(r.written + len(r.unreadable) for r in reports)
    print(f"[prepare_aishell] {transcript}: {len(texts)} transcripts, {empty} empty lines; "
          f"{len(texts) - used} transcripts have no wav in {', '.join(splits)}")
    return reports


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--aishell_dir", required=True,
                   help="the data_aishell directory (or the folder holding it)")
    p.add_argument("--out_dir", required=True, help="writes OUT_DIR/{split}/wav.scp, text, ...")
    p.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS,
                   help="splits to prepare")
    p.add_argument("--no_durations", action="store_true",
                   help="skip reading wav headers (no utt2dur, no unreadable-file check)")
    p.add_argument("--jsonl", action="store_true", help="also write data.list (needs durations)")
    p.add_argument("--untar", action="store_true", help="extract wav/*.tar.gz first")
    return p


def main(argv: list[str] | None = None) -> list[SplitReport]:
    args = get_parser().parse_args(argv)
    if args.jsonl and args.no_durations:
        raise SystemExit("--jsonl writes a duration field: drop --no_durations")
    try:
        reports = prepare(args.aishell_dir, args.out_dir, tuple(args.splits),
                          durations=not args.no_durations, jsonl=args.jsonl, untar=args.untar)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"[prepare_aishell] {e}") from e
    for r in reports:
        print(f"[prepare_aishell] {r.line()}")
        for kind, uids in (("without transcript", r.no_transcript), ("unreadable", r.unreadable)):
            if uids:
                print(f"[prepare_aishell]   {r.split} {kind}: {' '.join(uids[:5])}"
                      + (" ..." if len(uids) > 5 else ""))
    return reports


if __name__ == "__main__":
    main()
