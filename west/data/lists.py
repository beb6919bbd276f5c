"""Data lists: turn every input format into one record shape (west.data.records.Record:
key, source line, audio parts, and a transcript or a role-content conversation).

Formats: jsonl utterances (``key``/``wav``/``txt``, optional ``duration``,
``num_frames``, ``start``/``end``), jsonl role-content ``messages``, tar shard
lists (one ``.tar`` per line, read by offset through the index that
``west.data.shards`` writes beside the list) and Kaldi ``feats.scp`` + ``text``
(+ ``utt2num_frames``); with their optional extras, Lhotse manifests and Shar
directories (``west.data.lhotse_lists``) and Hugging Face datasets
(``west.data.hf_lists``). Every record names its source file and line (or row) so a
skip warning can point at it. ``open_list`` is the one dispatch from a path to its
source (``len()``, ``record(i)``).
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

from west.data.parsing import (
    check_text,
    decode_utf8,
    first_json,
    index_path,
    is_lhotse_item,
    parse_json_record,
    read_lines,
)
from west.data.records import AudioSpec, Record
from west.data.stats import DataStats, SkipSample

if TYPE_CHECKING:
    from west.data.config import DataConfig


class RawList:
    """A jsonl list held as raw lines (compact); records are parsed on demand.

    Lines that cannot be parsed are skipped and counted once, at load time.
    """

    def __init__(self, path: str, stats: DataStats, on_record: Optional[Callable[[Record], None]] = None):
        """``on_record`` sees every valid record once, while the list is read."""
        self.path = path
        self.base = os.path.dirname(os.path.abspath(path))
        self.lines: list[bytes] = []
        self.linenos: list[int] = []
        for lineno, raw in read_lines(path):
            src = f"{path}:{lineno}"
            try:
                rec = parse_json_record(raw, src, self.base)
            except SkipSample as e:
                stats.skip(e.category, src, e.message)
                continue
            self.lines.append(raw)
            self.linenos.append(lineno)
            if on_record is not None:
                on_record(rec)

    def __len__(self) -> int:
        return len(self.lines)

    def record(self, i: int) -> Record:
        return parse_json_record(self.lines[i], f"{self.path}:{self.linenos[i]}", self.base)


def _read_table(path: str, stats: Optional[DataStats]) -> dict[str, tuple[str, int]]:
    """Kaldi 'key value' table -> {key: (value, lineno)}."""
    table = {}
    for lineno, raw in read_lines(path):
        try:
            line = decode_utf8(raw, "line")
        except SkipSample as e:
            if stats is not None:
                stats.skip(e.category, f"{path}:{lineno}", e.message)
            continue
        parts = line.strip().split(maxsplit=1)
        table[parts[0]] = (parts[1] if len(parts) > 1 else "", lineno)
    return table


class KaldiList:
    """Kaldi data dir (or feats.scp): features read with kaldiio, transcripts from ``text``."""

    def __init__(self, path: str, stats: DataStats, on_record: Optional[Callable[[Record], None]] = None):
        scp = os.path.join(path, "feats.scp") if os.path.isdir(path) else path
        d = os.path.dirname(scp)
        self.path = scp
        texts = _read_table(os.path.join(d, "text"), stats) if os.path.exists(os.path.join(d, "text")) else {}
        n2f = os.path.join(d, "utt2num_frames")
        frames = _read_table(n2f, None) if os.path.exists(n2f) else {}
        self.items: list[dict] = []
        for key, (ark, lineno) in _read_table(scp, stats).items():
            src = f"{scp}:{lineno}"
            try:
                txt = check_text(texts[key][0] if key in texts else "", f"text of {key}")
            except SkipSample as e:
                stats.skip(e.category, src, e.message)
                continue
            nf = frames.get(key, (None,))[0]
            self.items.append({"key": key, "src": src, "txt": txt, "ark": ark,
                               "num_frames": int(nf) if nf and nf.isdigit() else None})
            if on_record is not None:
                on_record(self.record(len(self.items) - 1))

    def __len__(self) -> int:
        return len(self.items)

    def record(self, i: int) -> Record:
        it = self.items[i]
        return Record(it["key"], it["src"], [AudioSpec(ark=it["ark"], num_frames=it["num_frames"])], txt=it["txt"])


# -- tar shards, read through their index (written by west.data.shards) ----------------
def shard_paths(shard_list: str) -> list[tuple[str, str]]:
    """(tar path as written, resolved path) of every line (relative to cwd, else to the list)."""
    base = os.path.dirname(os.path.abspath(shard_list))
    out = []
    for _, raw in read_lines(shard_list):
        written = raw.decode("utf-8", errors="replace").strip()
        path = written if os.path.isabs(written) or os.path.exists(written) else os.path.join(base, written)
        out.append((written, path))
    return out


def _shard_record(raw: bytes, tar: str) -> Record:
    obj = json.loads(raw)
    if "skip" in obj:
        raise SkipSample(*obj["skip"])
    audio = AudioSpec(tar=tar, offset=obj["offset"], size=obj["size"], duration=obj.get("duration"),
                      num_frames=obj.get("num_frames"))
    return Record(obj["key"], f"{tar}:{obj['key']}", [audio], txt=check_text(obj["txt"], "transcript"))


class ShardList:
    """A shard list read through its index: records on demand, audio read by offset."""

    def __init__(self, path: str, stats: DataStats, on_record: Optional[Callable[[Record], None]] = None):
        idx = index_path(path)
        if not os.path.exists(idx):
            raise ValueError(f"{path}: tar shard list without its index {idx}; run "
                             f"`python tools/compute_lengths.py {path}` once to write it")
        tars = dict(shard_paths(path))
        self.path, self.tars = path, []
        self.lines: list[bytes] = []
        self.tar_of: list[int] = []
        current = -1
        for lineno, raw in read_lines(idx):
            obj = json.loads(decode_utf8(raw, f"{idx}:{lineno}"))
            if "tar" in obj:
                written = obj["tar"]
                resolved = tars.pop(written, None)
                if resolved is None:
                    raise ValueError(f"{idx}:{lineno}: {written} is not in {path}: the index is stale; "
                                     f"rerun tools/compute_lengths.py {path}")
                if os.path.exists(resolved) and os.path.getsize(resolved) != obj["bytes"]:
                    raise ValueError(f"{resolved} changed since {idx} was written; "
                                     f"rerun tools/compute_lengths.py {path}")
                self.tars.append(resolved)
                current += 1
                if "skip" in obj:
                    stats.skip(obj["skip"][0], f"{resolved} ({path})", obj["skip"][1])
                continue
            try:
                rec = _shard_record(raw, self.tars[current])
            except SkipSample as e:
                stats.skip(e.category, f"{self.tars[current]}:{obj.get('key')}", e.message)
                continue
            self.lines.append(raw)
            self.tar_of.append(current)
            if on_record is not None:
                on_record(rec)
        if tars:
            raise ValueError(f"{idx} lacks {sorted(tars)[0]} (and {len(tars) - 1} more) of {path}; "
                             f"rerun tools/compute_lengths.py {path}")

    def __len__(self) -> int:
        return len(self.lines)

    def record(self, i: int) -> Record:
        return _shard_record(self.lines[i], self.tars[self.tar_of[i]])


# -- one dispatch from a path to its source ------------------------------------------
Source = Union[RawList, KaldiList, ShardList]  # one list format: len(), record(i) (and the optional kinds)


def _lhotse(path: str, stats: DataStats, on_record, conf) -> "Source":
    if os.path.isdir(path):   # Lhotse's directory form
        return _shar(path, stats, on_record, conf)
    from west.data.lhotse_lists import LhotseList  # optional extra: lhotse

    return LhotseList(path, stats, on_record)


def _shar(path: str, stats: DataStats, on_record, conf) -> "Source":
    from west.data.shar import SharList  # optional extra: lhotse

    return SharList(path, stats, on_record)


def _hf(path: str, stats: DataStats, on_record, conf) -> "Source":
    from west.data.hf_lists import HFList  # optional extra: datasets

    return HFList(path, stats, on_record, conf)


# data_type -> source(path, stats, on_record, conf)
SOURCES = {"raw": lambda p, s, r, c: RawList(p, s, r), "kaldi": lambda p, s, r, c: KaldiList(p, s, r),
           "shard": lambda p, s, r, c: ShardList(p, s, r), "lhotse": _lhotse, "shar": _shar, "hf": _hf}


def _detect_dir(path: str) -> str:
    """shar (cuts.NNNNNN.jsonl.gz), hf (a saved dataset, parquet files), else a Kaldi data dir."""
    names = os.listdir(path)
    if any(n.startswith("cuts.") and n.endswith((".jsonl.gz", ".jsonl")) for n in names):
        return "shar"
    if {"state.json", "dataset_dict.json"} & set(names) or any(n.endswith(".parquet") for n in names):
        return "hf"
    return "kaldi"


def detect_data_type(path: str) -> str:
    """raw | shard | kaldi | lhotse | shar | hf, from the path and the first non-blank line."""
    if os.path.isdir(path):
        return _detect_dir(path)
    if path.endswith(".scp"):
        return "kaldi"
    if path.endswith(".parquet"):
        return "hf"
    if path.endswith(".gz"):   # lhotse writes its manifests gzipped; west's lists are plain text
        return "lhotse"
    for _, raw in read_lines(path):
        line = raw.strip()
        if line.endswith((b".tar", b".tar.gz", b".tgz")):
            return "shard"
        if line.endswith(b".parquet"):
            return "hf"   # a list of parquet files
        return "lhotse" if is_lhotse_item(first_json(path)) else "raw"
    return "raw"


def open_list(path: str, stats: DataStats, data_type: str = "auto",
              on_record: Optional[Callable[[Record], None]] = None, conf: Optional["DataConfig"] = None) -> Source:
    """The source for ``path`` (``data_type`` auto detects it); ``conf`` names a dataset's columns."""
    kind = detect_data_type(path) if data_type == "auto" else data_type
    return SOURCES[kind](path, stats, on_record, conf)


def iter_records(path: str, stats: DataStats, data_type: str = "auto",
                 conf: Optional["DataConfig"] = None) -> Iterator[Record]:
    """Every record of any list format, in list order (decoding, CMVN, statistics)."""
    source = open_list(path, stats, data_type, conf=conf)
    for i in range(len(source)):
        yield source.record(i)
