"""Lengths of a Hugging Face dataset without a duration column, measured once and kept beside it.

Every epoch is planned from lengths. ``tools/compute_lengths.py PATH``
(``west.data.hf_lists.write_hf_index``) reads each row's audio header (soundfile, no decoding)
and writes ``index_path(PATH)`` (``DIR.west.idx`` beside a directory, ``FILE.idx`` for a parquet
file or list), JSON lines:

    {"parts": [["train", 1048576, 2000]]}                            # each table: name, bytes, rows
    [[298, 3.0]]                                                     # a row: [fbank frames, seconds] per audio part
    {"skip": ["corrupt_audio", "cannot read audio header: ..."]}     # a row found bad: counted by the loader

A table whose size or row count changed makes the index stale: an error up front.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Optional

import numpy as np

from west.data.parsing import index_path, read_lines
from west.data.stats import SkipSample


def parts_header(parts) -> list:
    """What the index was measured on: each table's name, bytes and rows (west.data.hf_lists.Part)."""
    return [[os.path.basename(p.name.rstrip("/")), p.size, p.rows] for p in parts]


class Lengths:
    """The index in memory: flat arrays, one span per row."""

    def __init__(self, starts: np.ndarray, values: np.ndarray, skips: dict):
        self.starts, self.values, self.skips = starts, values, skips

    def row(self, g: int) -> np.ndarray:
        """[[frames, seconds], ...] of row ``g`` (all tables counted); raises the row's skip."""
        if g in self.skips:
            raise SkipSample(*self.skips[g])
        return self.values[self.starts[g]:self.starts[g + 1]]


def read_lengths(path: str, parts) -> Optional[Lengths]:
    """The index of ``path`` (None if there is none); a stale one is an error naming the tool."""
    idx = index_path(path)
    if not os.path.exists(idx):
        return None
    lines = read_lines(idx)
    header = json.loads(next(lines, (0, b"{}"))[1])
    if header.get("parts") != parts_header(parts):
        raise ValueError(f"{idx} was written for other data ({header.get('parts')}, now {parts_header(parts)}): "
                         f"rerun `python tools/compute_lengths.py {path}`")
    starts, values, skips = [0], [], {}
    for g, (_, raw) in enumerate(lines):
        obj = json.loads(raw)
        if isinstance(obj, dict):
            skips[g] = tuple(obj["skip"])
        else:
            values.extend(obj)
        starts.append(len(values))
    return Lengths(np.asarray(starts, np.int64), np.asarray(values, np.float64).reshape(-1, 2), skips)


def write_lengths(path: str, parts, rows: Iterable[object]) -> None:
    """Write the index of ``path``: its header, then one line per row ([[frames, seconds], ...] or
    {"skip": [category, why]}), in row order over all tables."""
    out = index_path(path)
    tmp = out + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"parts": parts_header(parts)}, ensure_ascii=False) + "\n")
        for line in rows:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
