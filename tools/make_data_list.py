#!/usr/bin/env python3
"""Kaldi-style data dir (wav.scp + text [+ segments] [+ utt2dur]) -> west jsonl list.

One line per utterance: {"key", "wav", "txt", "duration"[, "start", "end"]}.
Durations come from utt2dur, from segments (end - start) or, with
--compute_duration, from the audio header. Utterances without a transcript or
audio are reported and left out (the count is printed). The work is done by
west.prep.data_list; this is its command line.

    python tools/make_data_list.py --wav_scp data/train/wav.scp --text data/train/text \
        [--segments data/train/segments] [--compute_duration] data/train/data.list
"""
from __future__ import annotations

import argparse
import sys

from west.prep.data_list import write_data_list


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
    write_data_list(a.out, a.wav_scp, a.text, a.segments, a.utt2dur, a.compute_duration, a.keep_paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
