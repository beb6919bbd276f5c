#!/usr/bin/env python3
"""jsonl list -> tar shards of KEY.<audio ext> + KEY.txt, plus a shard list.

The layout WeNet's make_shard_list.py writes, plus the index the loader plans
epochs from and reads members by (``SHARD_LIST.idx``, west.data.shards).
Audio bytes are copied as they are (wav, flac, ...); a segment (start/end) is
cut and stored as 16-bit wav. Conversation (``messages``) lines cannot be
sharded and are reported.

    python tools/make_shard_list.py data/train/data.list data/train/shards \
        --num_utts_per_shard 1000   # writes data/train/shards/shards.list
"""
from __future__ import annotations

import argparse
import sys

from west.data.config import DataConfig
from west.prep.shards import make_shards


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_list")
    p.add_argument("out_dir")
    p.add_argument("--num_utts_per_shard", type=int, default=1000)
    p.add_argument("--prefix", default="shards")
    p.add_argument("--shard_list", help="default: OUT_DIR/PREFIX.list")
    p.add_argument("--sample_rate", type=int, default=16000, help="lengths in the index: as the loader computes")
    p.add_argument("--frame_length_ms", type=float, default=25.0)
    p.add_argument("--frame_shift_ms", type=float, default=10.0)
    a = p.parse_args(argv)
    conf = DataConfig(sample_rate=a.sample_rate, frame_length_ms=a.frame_length_ms, frame_shift_ms=a.frame_shift_ms)
    path, n, problems = make_shards(a.data_list, a.out_dir, a.num_utts_per_shard, a.prefix, a.shard_list, conf)
    for msg in problems[:20]:
        print(f"warning: {msg}", file=sys.stderr)
    print(f"wrote {n} utterances into shards listed in {path}; {len(problems)} problem(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
