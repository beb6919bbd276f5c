"""One dispatch from a list path to its source of records (jsonl, Kaldi dir, tar shards).

A source has ``len()`` and ``record(i)``, and calls ``on_record`` once per valid
record while it is read (the lengths table listens there, so a list is parsed
once). Lines that cannot be parsed are counted in ``stats`` at that time.
"""
from __future__ import annotations

import os
from typing import Callable, Iterator, Optional, Union

from west.data.lists import KaldiList, RawList, read_lines
from west.data.shards import ShardList
from west.data.stats import DataStats

Source = Union[RawList, KaldiList, ShardList]
SOURCES = {"raw": RawList, "kaldi": KaldiList, "shard": ShardList}


def detect_data_type(path: str) -> str:
    """raw | shard | kaldi, from the path and the first non-blank line."""
    if os.path.isdir(path) or path.endswith(".scp"):
        return "kaldi"
    for _, raw in read_lines(path):
        return "shard" if raw.strip().endswith((b".tar", b".tar.gz", b".tgz")) else "raw"
    return "raw"


def open_list(path: str, stats: DataStats, data_type: str = "auto",
              on_record: Optional[Callable[[dict], None]] = None) -> Source:
    """The source for ``path`` (``data_type`` auto detects it)."""
    kind = detect_data_type(path) if data_type == "auto" else data_type
    return SOURCES[kind](path, stats, on_record)


def iter_records(path: str, stats: DataStats, data_type: str = "auto") -> Iterator[dict]:
    """Every record of any list format, in list order (decoding, CMVN, statistics)."""
    source = open_list(path, stats, data_type)
    for i in range(len(source)):
        yield source.record(i)
