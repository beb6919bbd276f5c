#!/usr/bin/env python3
"""Global CMVN statistics of fbank features -> JSON (WeNet's global_cmvn format).

Writes {"mean_stat": Σx, "var_stat": Σx², "frame_num": N} over all frames,
computed with exactly the training features (same fbank options, no dither).
Any list format works (jsonl, shard list, Kaldi dir).

    python tools/compute_cmvn.py data/train/data.list data/train/global_cmvn.json [--num_utts 2000]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np

from west.data.config import DataConfig
from west.data.lists import iter_records
from west.data.processors import DecodeContext, fbank, load_audio
from west.data.stats import DataStats


def compute_cmvn(data_list: str, conf: DataConfig, num_utts: int = 0) -> tuple[dict, DataStats]:
    stats = DataStats(conf.max_warnings)
    ctx = DecodeContext(conf, encoder=None, stats=stats, training=False)
    records = iter_records(data_list, stats, conf.data_type, conf=conf)
    if num_utts:
        records = itertools.islice(records, num_utts)
    total = np.zeros(conf.num_mel_bins, np.float64)
    total_sq = np.zeros(conf.num_mel_bins, np.float64)
    frames = 0
    for s in fbank(load_audio(records, ctx), ctx):
        for f in s.feats:
            f = f.astype(np.float64)
            total += f.sum(0)
            total_sq += (f * f).sum(0)
            frames += f.shape[0]
    if frames == 0:
        raise SystemExit(f"no usable audio in {data_list}: {stats.summary()}")
    return {"mean_stat": total.tolist(), "var_stat": total_sq.tolist(), "frame_num": frames}, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_list")
    p.add_argument("out_json")
    p.add_argument("--num_utts", type=int, default=0, help="use only the first N utterances (0 = all)")
    p.add_argument("--num_mel_bins", type=int, default=80)
    p.add_argument("--data_type", default="auto")
    p.add_argument("--audio_column", default="audio", help="a Hugging Face dataset's audio column")
    p.add_argument("--text_column", default=None, help="its text column (default: the first of text, sentence, ...)")
    a = p.parse_args(argv)
    conf = DataConfig(num_mel_bins=a.num_mel_bins, data_type=a.data_type, audio_column=a.audio_column,
                      text_column=a.text_column)
    cmvn, stats = compute_cmvn(a.data_list, conf, a.num_utts)
    with open(a.out_json, "w", encoding="utf-8") as f:
        json.dump(cmvn, f)
    print(f"{cmvn['frame_num']} frames -> {a.out_json}; {stats.summary()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
