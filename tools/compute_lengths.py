#!/usr/bin/env python3
"""Add exact lengths to a jsonl list so the loader can plan whole epochs.

For every audio (the utterance's ``wav`` or each audio part of a conversation)
it reads the header only (no decoding) and writes ``num_frames`` (fbank frames
after resampling to --sample_rate, what the loader will compute) and
``duration`` (seconds). With exact lengths a planned pack never overflows.
Lines whose audio cannot be read are kept unchanged and reported (the loader
will skip and count them); --drop_bad leaves them out instead.

    python tools/compute_lengths.py data/train/data.list data/train/data.len.list
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from west.data.audio import audio_num_samples  # noqa: E402
from west.data.config import DataConfig  # noqa: E402
from west.data.features import fbank_frames  # noqa: E402
from west.data.lists import parse_json_record, read_lines  # noqa: E402
from west.data.stats import SkipSample  # noqa: E402


def _audio_dicts(obj: dict) -> list[dict]:
    """The JSON dicts that carry each audio, in the order records list them."""
    if "messages" not in obj:
        return [obj]
    out = []
    for msg in obj["messages"]:
        content = msg["content"]
        for item in content if isinstance(content, list) else [content]:
            if isinstance(item, dict) and item.get("type") == "audio":
                out.append(item)
    return out


def add_lengths(in_list: str, out_list: str, conf: DataConfig, drop_bad: bool = False) -> tuple[int, list[str]]:
    """Returns (lines written, problems)."""
    base = os.path.dirname(os.path.abspath(in_list))
    problems, written = [], 0
    with open(out_list, "wb") as out:
        for lineno, raw in read_lines(in_list):
            src = f"{in_list}:{lineno}"
            try:
                rec = parse_json_record(raw, src, base)
                obj = json.loads(raw.decode("utf-8"))
                for spec, target in zip(rec["audio"], _audio_dicts(obj)):
                    n = audio_num_samples(spec, conf.sample_rate)
                    target["num_frames"] = fbank_frames(n, conf)
                    target["duration"] = round(n / conf.sample_rate, 4)
                line = json.dumps(obj, ensure_ascii=False).encode("utf-8")
            except SkipSample as e:
                problems.append(f"{src}: [{e.category}] {e.message}")
                if drop_bad:
                    continue
                line = raw                       # kept byte for byte
            out.write(line + b"\n")
            written += 1
    return written, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("in_list")
    p.add_argument("out_list")
    p.add_argument("--sample_rate", type=int, default=16000)
    p.add_argument("--frame_length_ms", type=float, default=25.0)
    p.add_argument("--frame_shift_ms", type=float, default=10.0)
    p.add_argument("--drop_bad", action="store_true", help="leave unreadable lines out")
    a = p.parse_args(argv)
    conf = DataConfig(sample_rate=a.sample_rate, frame_length_ms=a.frame_length_ms, frame_shift_ms=a.frame_shift_ms)
    n, problems = add_lengths(a.in_list, a.out_list, conf, a.drop_bad)
    for msg in problems[:20]:
        print(f"warning: {msg}", file=sys.stderr)
    print(f"wrote {n} lines to {a.out_list}; {len(problems)} problem(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
