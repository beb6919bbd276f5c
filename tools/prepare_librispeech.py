#!/usr/bin/env python3
"""Kaldi-style lists (wav.scp, text, utt2dur, data.list) per subset of a LibriSpeech tree.

Works on the real corpus and on the one tools/synthesize_librispeech.py writes (same layout):

    LibriSpeech/SUBSET/SPEAKER/CHAPTER/SPEAKER-CHAPTER-NNNN.flac
    LibriSpeech/SUBSET/SPEAKER/CHAPTER/SPEAKER-CHAPTER.trans.txt     # "SPEAKER-CHAPTER-NNNN WORDS ..."

SUBSET is any of train-clean-100, train-clean-360, train-other-500, dev-clean, dev-other,
test-clean, test-other; each goes to OUT_DIR/SUBSET with '-' written '_' (data/dev_clean).
Transcripts are lower-cased by default (``--case keep`` leaves LibriSpeech's capitals): a
pretrained LLM's tokenizer spells lower-case English in the fewest tokens, and the
``english`` scoring normalizer folds case anyway. Files are sorted by utterance id, paths
absolute, and ``data.list`` lines ``{"key", "wav", "txt", "duration"}`` come from
west.prep.data_list through tools/prepare_aishell.py's writer.

Bad input never stops a subset and is never lost silently: a chapter without its
``.trans.txt``, a FLAC without a transcript line, a transcript line without its FLAC, an empty
transcript line, an id seen twice and a FLAC whose header cannot be read are each counted,
the first few named on the console, and all of them listed in OUT_DIR/SUBSET/skipped.txt
("category<TAB>id or path" lines).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from prepare_aishell import audio_seconds, write_lists

SUBSETS = ("train-clean-100", "train-clean-360", "train-other-500", "dev-clean", "dev-other",
           "test-clean", "test-other")
# category -> how the report names it; the order of the console report
PROBLEMS = {
    "no_trans_file": "chapters without .trans.txt",
    "no_transcript": "FLACs without a transcript line",
    "no_audio": "transcript lines without a FLAC",
    "empty_transcript": "empty transcript lines",
    "duplicate": "ids seen twice",
    "unreadable": "unreadable FLACs",
}
SHOWN = 5  # names per category printed on the console (skipped.txt has them all)


@dataclass
class SubsetReport:
    """What one subset produced and what it had to leave out."""

    subset: str
    speakers: int = 0
    chapters: int = 0
    written: int = 0
    seconds: float = 0.0
    problems: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in PROBLEMS})

    def line(self) -> str:
        hours = f", {self.seconds / 3600:.2f} h" if self.seconds else ""
        left = ", ".join(f"{len(v)} {PROBLEMS[k]}" for k, v in self.problems.items() if v) or "nothing"
        return (f"{self.subset}: {self.written} utterances{hours} from {self.speakers} speakers, "
                f"{self.chapters} chapters; left out {left}")


def data_dir_name(subset: str) -> str:
    """dev-clean -> dev_clean (the recipe's data/ folder of a subset)."""
    return subset.replace("-", "_")


def find_root(path: str | Path) -> Path:
    """The LibriSpeech folder: ``path`` itself or its LibriSpeech/ child."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    if (path / "LibriSpeech").is_dir() and not any((path / s).is_dir() for s in SUBSETS):
        return path / "LibriSpeech"
    return path


def read_chapter(trans: Path, report: SubsetReport, seen: set[str]) -> tuple[dict[str, str], set[str]]:
    """(id -> words of one .trans.txt, the ids reported here): empty and repeated lines are
    reported, not kept."""
    texts: dict[str, str] = {}
    reported: set[str] = set()
    with open(trans, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split(maxsplit=1)
            if not parts:
                continue
            uid = parts[0]
            if uid in seen:
                report.problems["duplicate"].append(f"{uid} ({trans}:{lineno})")
                reported.add(uid)
                continue
            seen.add(uid)
            if len(parts) == 1 or not parts[1].strip():
                report.problems["empty_transcript"].append(f"{uid} ({trans}:{lineno})")
                reported.add(uid)
                continue
            texts[uid] = " ".join(parts[1].split())
    return texts, reported


def scan_subset(subset_dir: Path, report: SubsetReport, case: str = "lower", durations: bool = True
                ) -> list[tuple[str, Path, str, float | None]]:
    """(uid, flac, text, seconds) of every usable utterance, sorted by uid."""
    rows, seen = [], set()
    for spk in sorted(p for p in subset_dir.iterdir() if p.is_dir()):
        report.speakers += 1
        for chapter in sorted(p for p in spk.iterdir() if p.is_dir()):
            report.chapters += 1
            flacs = {p.name[:-len(".flac")]: p.absolute() for p in sorted(chapter.glob("*.flac"))}
            trans = chapter / f"{spk.name}-{chapter.name}.trans.txt"
            if not trans.is_file():
                found = sorted(chapter.glob("*.trans.txt"))
                trans = found[0] if len(found) == 1 else trans
            if not trans.is_file():
                report.problems["no_trans_file"].append(str(chapter))
                report.problems["no_transcript"] += sorted(flacs)
                continue
            texts, reported = read_chapter(trans, report, seen)
            report.problems["no_audio"] += sorted(u for u in texts if u not in flacs)
            for uid, flac in flacs.items():
                if uid not in texts:
                    if uid not in reported:   # an empty or repeated line was counted already
                        report.problems["no_transcript"].append(uid)
                    continue
                dur = None
                if durations:
                    dur = audio_seconds(flac)
                    if dur is None:
                        report.problems["unreadable"].append(uid)
                        continue
                    report.seconds += dur
                text = texts[uid].lower() if case == "lower" else texts[uid]
                rows.append((uid, flac, text, dur))
    rows.sort(key=lambda r: r[0])
    return rows


def prepare(data_root: str | Path, out_dir: str | Path, subsets: tuple[str, ...], case: str = "lower",
            durations: bool = True, jsonl: bool = True) -> list[SubsetReport]:
    """Lists for every subset; raises FileNotFoundError naming what is missing."""
    root = find_root(data_root)
    missing = [s for s in subsets if not (root / s).is_dir()]
    if missing:
        have = [s for s in SUBSETS if (root / s).is_dir()]
        raise FileNotFoundError(f"{root} has no {', '.join(missing)} folder (found: {', '.join(have) or 'none'}); "
                                "is it a LibriSpeech directory?")
    reports = []
    for subset in subsets:
        report = SubsetReport(subset)
        rows = scan_subset(root / subset, report, case, durations)
        out = Path(out_dir) / data_dir_name(subset)
        write_lists(out, rows, durations, jsonl)
        with open(out / "skipped.txt", "w", encoding="utf-8") as f:
            for kind, names in report.problems.items():
                f.writelines(f"{kind}\t{name}\n" for name in names)
        report.written = len(rows)
        reports.append(report)
    return reports


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data_root", required=True, help="the LibriSpeech directory (or the folder holding it)")
    p.add_argument("--out_dir", required=True, help="writes OUT_DIR/SUBSET/{wav.scp,text,utt2dur,data.list}")
    p.add_argument("--subsets", nargs="+", default=["train-clean-100", "dev-clean", "test-clean"],
                   choices=SUBSETS, help="subsets to prepare")
    p.add_argument("--case", choices=("lower", "keep"), default="lower", help="transcript case")
    p.add_argument("--no_durations", action="store_true",
                   help="skip reading FLAC headers (no utt2dur, no data.list, no unreadable-file check)")
    return p


def main(argv: list[str] | None = None) -> list[SubsetReport]:
    args = get_parser().parse_args(argv)
    try:
        reports = prepare(args.data_root, args.out_dir, tuple(args.subsets), args.case,
                          durations=not args.no_durations, jsonl=not args.no_durations)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"[prepare_librispeech] {e}") from e
    for r in reports:
        print(f"[prepare_librispeech] {r.line()}")
        for kind, names in r.problems.items():
            if names:
                print(f"[prepare_librispeech]   {r.subset} {PROBLEMS[kind]}: {' '.join(names[:SHOWN])}"
                      + (f" ... (all in {Path(args.out_dir) / data_dir_name(r.subset) / 'skipped.txt'})"
                         if len(names) > SHOWN else ""))
    return reports


if __name__ == "__main__":
    main()
