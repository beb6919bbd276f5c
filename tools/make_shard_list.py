#!/usr/bin/env python3
"""jsonl list -> tar shards of KEY.<audio ext> + KEY.txt, plus a shard list.

The layout WeNet's make_shard_list.py writes, so the loader streams either.
Audio bytes are copied as they are (wav, flac, ...); a segment (start/end) is
cut and stored as 16-bit wav. Conversation (``messages``) lines cannot be
sharded and are reported.

    python tools/make_shard_list.py data/train/data.list data/train/shards \
        --num_utts_per_shard 1000   # writes data/train/shards/shards.list
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import soundfile as sf  # noqa: E402

from west.data.audio import resolve_path  # noqa: E402
from west.data.lists import RawList  # noqa: E402
from west.data.stats import DataStats  # noqa: E402


def _audio_member(spec: dict) -> tuple[bytes, str]:
    path = resolve_path(spec["path"], spec.get("base"))
    if spec.get("start") is None and spec.get("end") is None:
        with open(path, "rb") as f:
            return f.read(), os.path.splitext(path)[1].lstrip(".").lower() or "wav"
    with sf.SoundFile(path) as f:
        sr = f.samplerate
        start = int(round((spec.get("start") or 0.0) * sr))
        stop = int(round(spec["end"] * sr)) if spec.get("end") is not None else f.frames
        f.seek(start)
        data = f.read(max(stop - start, 0), dtype="int16")
    buf = io.BytesIO()
    sf.write(buf, data, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue(), "wav"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def make_shards(data_list: str, out_dir: str, num_utts_per_shard: int = 1000, prefix: str = "shards",
                shard_list: str | None = None) -> tuple[str, int, list[str]]:
    """Write shards; returns (shard list path, utterances written, problems)."""
    os.makedirs(out_dir, exist_ok=True)
    stats = DataStats(max_warnings=0)
    src = RawList(data_list, stats)
    problems = [f"{c}: {n} line(s) unreadable" for c, n in stats.as_dict().items()]
    shard_list = shard_list or os.path.join(out_dir, f"{prefix}.list")
    shards, tar, written, in_shard = [], None, 0, 0
    for i in range(len(src)):
        rec = src.record(i)
        if rec["messages"] is not None:
            problems.append(f"{rec['src']}: conversation lines cannot be sharded")
            continue
        try:
            audio, ext = _audio_member(rec["audio"][0])
        except Exception as e:  # missing/corrupt audio: report, keep going
            problems.append(f"{rec['src']}: {type(e).__name__}: {e}")
            continue
        if tar is None or in_shard >= num_utts_per_shard:
            if tar is not None:
                tar.close()
            path = os.path.abspath(os.path.join(out_dir, f"{prefix}_{len(shards):06d}.tar"))
            tar, in_shard = tarfile.open(path, "w"), 0
            shards.append(path)
        _add(tar, f"{rec['key']}.txt", rec["txt"].encode("utf-8"))
        _add(tar, f"{rec['key']}.{ext}", audio)
        in_shard += 1
        written += 1
    if tar is not None:
        tar.close()
    with open(shard_list, "w", encoding="utf-8") as f:
        f.writelines(s + "\n" for s in shards)
    return shard_list, written, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_list")
    p.add_argument("out_dir")
    p.add_argument("--num_utts_per_shard", type=int, default=1000)
    p.add_argument("--prefix", default="shards")
    p.add_argument("--shard_list", help="default: OUT_DIR/PREFIX.list")
    a = p.parse_args(argv)
    path, n, problems = make_shards(a.data_list, a.out_dir, a.num_utts_per_shard, a.prefix, a.shard_list)
    for msg in problems[:20]:
        print(f"warning: {msg}", file=sys.stderr)
    print(f"wrote {n} utterances into shards listed in {path}; {len(problems)} problem(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
