"""Hugging Face datasets as data lists (the ``datasets`` extra).

A path is one split of a dataset: a directory written by ``Dataset.save_to_disk`` (a
``DatasetDict``'s split is its subdirectory, ``DIR/train``), one ``.parquet`` file, a directory
of parquet files of one split, or a text file listing parquet files (one per line; how to pick
one split out of the Hub's ``data/SPLIT-NNNNN-of-NNNNN.parquet``). Parquet files are read
through ``datasets``' own Arrow cache (``Dataset.from_parquet``, as ``load_dataset`` does), so
rows are memory-mapped and read one by one.

Columns (``data.*_column``): the audio (an ``Audio`` column's ``{bytes, path}`` cells, or plain
bytes or path cells), decoded with soundfile from the bytes, else from the path (relative paths
are tried from the working directory, then from the dataset's folder), never through
``datasets``' own decoding (no torchcodec or FFmpeg); the transcript (the first of
``TEXT_COLUMNS`` present unless named); the key (``id`` when present, else ``NAME:ROW``);
conversations (``messages``: role/content turns as in jsonl, an audio part without a path being
the row's own audio). Lengths come from the index ``tools/compute_lengths.py PATH`` writes once
beside the data (exact frame counts; ``west.data.hf_index``) when there is one, else from a
``duration`` column (seconds). Only the small columns are read to plan; the audio of a row is
read when a batch needs it.
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from west.data.extras import require
from west.data.hf_index import read_lengths, write_lengths
from west.data.parsing import check_text, parse_messages, read_lines
from west.data.records import AudioSpec, Record
from west.data.stats import DataStats, SkipSample

TEXT_COLUMNS = ("text", "sentence", "transcription", "transcript", "normalized_text")
SPLIT_FILE = re.compile(r"^(.+?)-\d{5}-of-\d{5}\.parquet$")
_CHUNK = 4096


def import_datasets(path: str):
    """The datasets module, or an error saying that ``path`` needs the datasets extra."""
    return require("datasets", path, "a Hugging Face dataset")


@contextlib.contextmanager
def _quiet(datasets):
    """No progress bars while west opens a dataset (restored after)."""
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def _example(splits: list[str]) -> str:
    return "train" if "train" in splits or not splits else splits[0]


def parquet_files(path: str) -> list[str]:
    """The parquet files of ``path``: itself, a directory's (one split), or a list file's lines."""
    if path.endswith(".parquet"):
        return [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".parquet"))
        splits = sorted({m.group(1) for f in files if (m := SPLIT_FILE.match(os.path.basename(f)))})
        if len(splits) > 1:
            one = _example(splits)
            raise ValueError(f"{path} holds the parquet files of several splits ({', '.join(splits)}): list one "
                             f"split's files in a text file and give that, e.g. `ls {path}/{one}-*.parquet "
                             f"> {one}.parquet.list`")
        return files
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for _, raw in read_lines(path):
        name = raw.decode("utf-8", errors="replace").strip()
        out.append(name if os.path.isabs(name) or os.path.exists(name) else os.path.join(base, name))
    return out


@dataclass
class Part:
    """One Arrow table of the list: a saved dataset, or one parquet file."""

    name: str                  # what a skip names: the dataset directory or the parquet file
    ds: Any                    # datasets.Dataset (None: the file is missing)
    base: str                  # the folder relative audio paths are tried against
    size: int                  # bytes on disk (the index's staleness check)
    cols: dict                 # role -> column name (None: absent)
    problem: str = ""          # a required column is missing: every row is skipped, naming it

    @property
    def rows(self) -> int:
        return 0 if self.ds is None else len(self.ds)


def _columns(names: list[str], conf) -> tuple[dict, str]:
    """Column roles for a table with ``names``, and what is missing ("" if nothing)."""
    def opt(key: str, default: str) -> Optional[str]:
        want = getattr(conf, key, None) or default
        return want if want in names else None

    text_key = getattr(conf, "text_column", None)
    cols = {"audio": opt("audio_column", "audio"), "duration": opt("duration_column", "duration"),
            "key": opt("key_column", "id"), "messages": opt("messages_column", "messages"),
            "text": (text_key if text_key in names else None) if text_key
            else next((c for c in TEXT_COLUMNS if c in names), None)}
    missing = []
    if cols["messages"] is None:
        if cols["audio"] is None:
            missing.append(f"no audio column {getattr(conf, 'audio_column', None) or 'audio'!r} (data.audio_column)")
        if cols["text"] is None:
            missing.append(f"no text column ({repr(text_key) if text_key else ' / '.join(TEXT_COLUMNS)}; "
                           "data.text_column)")
    return cols, "; ".join(missing) + (f"; its columns: {', '.join(names)}" if missing else "")


def open_parts(path: str, conf) -> list[Part]:
    """The tables of ``path`` with their column roles (see the module doc for the forms of a path)."""
    datasets = import_datasets(path)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)))
        raise ValueError(f"{path} is a DatasetDict with the splits {', '.join(splits)}: give one split's "
                         f"directory, e.g. {os.path.join(path, _example(splits))}")
    with _quiet(datasets):
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "state.json")):
            ds = datasets.load_from_disk(path)
            size = sum(os.path.getsize(f["filename"]) for f in ds.cache_files)
            tables = [(path, ds, path, size)]
        else:
            tables = [(f, datasets.Dataset.from_parquet(f) if os.path.exists(f) else None,
                       os.path.dirname(os.path.abspath(f)), os.path.getsize(f) if os.path.exists(f) else -1)
                      for f in parquet_files(path)]
    parts = []
    for name, ds, base, size in tables:
        cols, problem = _columns(list(ds.column_names), conf) if ds is not None else ({}, "")
        if ds is not None:
            ds = ds.select_columns([c for c in dict.fromkeys(cols.values()) if c]).with_format("arrow")
        parts.append(Part(name, ds, base, size, cols, problem))
    return parts


def audio_cell(value: object, base: str) -> AudioSpec:
    """An audio cell -> where its audio is: the bytes (an ``Audio`` cell's or a binary column's),
    else the path."""
    path = value
    if isinstance(value, dict):
        if value.get("bytes"):
            return AudioSpec(data=bytes(value["bytes"]))
        path = value.get("path")
    elif isinstance(value, (bytes, bytearray)) and value:
        return AudioSpec(data=bytes(value))
    if not isinstance(path, str) or not path:
        raise SkipSample("missing_file", "the row's audio cell holds neither bytes nor a path")
    return AudioSpec(path=path, base=base)


def row_record(part: Part, r: int, row: dict, with_audio: bool,
               lengths: Optional[np.ndarray] = None) -> Record:
    """One row -> one record; ``with_audio`` False: lengths only (planning reads no audio)."""
    cols = part.cols
    src = f"{part.name} row {r}"
    dur = row.get(cols["duration"]) if cols["duration"] else None
    if dur is not None and (isinstance(dur, bool) or not isinstance(dur, (int, float)) or dur < 0):
        raise SkipSample("malformed_line", f"column {cols['duration']!r} must be a non-negative number, got {dur!r}")

    def cell(what: str = "") -> AudioSpec:
        if cols["audio"] is None:
            raise SkipSample("malformed_line", f"{what}: an audio part without a path, and no audio column")
        value = row.get(cols["audio"])
        if with_audio:
            spec = audio_cell(value, part.base)
        elif value is None:
            raise SkipSample("missing_file", f"the row's audio cell ({cols['audio']!r}) holds neither bytes nor a path")
        else:
            spec = AudioSpec()
        spec.duration = None if dur is None else float(dur)
        return spec

    key = row.get(cols["key"]) if cols["key"] else None
    key = str(key) if key is not None and str(key) else f"{os.path.basename(part.name.rstrip('/'))}:{r}"
    msgs = row.get(cols["messages"]) if cols["messages"] else None
    if msgs is not None:
        messages, audio = parse_messages(msgs, part.base, cell=cell)
        rec = Record(key, src, audio, messages=messages)
    else:
        txt = check_text(row.get(cols["text"]) or "" if cols["text"] else "", f"column {cols['text']!r}")
        rec = Record(key, src, [cell()], txt=txt)
    if lengths is not None:
        if len(lengths) != len(rec.audio):
            raise SkipSample("malformed_line", f"the lengths index has {len(lengths)} audio part(s) for this row, "
                                               f"the row {len(rec.audio)}: rerun tools/compute_lengths.py")
        for spec, (frames, secs) in zip(rec.audio, lengths):
            spec.num_frames, spec.duration = int(frames), float(secs)
    return rec


def iter_rows(part: Part, with_audio: bool):
    """(row number, row dict) of every row; without audio, the audio column is only checked for a
    value (bytes or path), so planning reads no audio bytes."""
    import pyarrow.compute as pc  # optional extra: datasets (pyarrow)

    audio = part.cols.get("audio")
    for start in range(0, part.rows, _CHUNK):
        table = part.ds[start:start + _CHUNK]
        present = None
        if audio is not None and not with_audio:
            column = table.column(audio)
            if hasattr(column.type, "get_field_index"):   # an Audio column: {bytes, path}
                present = pc.or_(pc.is_valid(pc.struct_field(column, "bytes")),
                                 pc.is_valid(pc.struct_field(column, "path")))
            else:
                present = pc.is_valid(column)
            present = pc.and_(present, pc.is_valid(column)).to_pylist()
            table = table.drop_columns([audio])
        for j, row in enumerate(table.to_pylist()):
            if present is not None:
                row[audio] = True if present[j] else None
            yield start + j, row


class HFList:
    """One split of a Hugging Face dataset: records on demand, each row's audio read when decoded."""

    def __init__(self, path: str, stats: DataStats, on_record: Optional[Callable[[Record], None]] = None,
                 conf=None):
        self.path = path
        self.parts = open_parts(path, conf)
        if all(p.problem for p in self.parts if p.ds is not None) and any(p.ds is not None for p in self.parts):
            raise ValueError(f"{path}: {next(p.problem for p in self.parts if p.problem)}")
        self.lengths = read_lengths(path, self.parts)
        if self.lengths is None and any(p.cols.get("duration") is None for p in self.parts if p.ds is not None):
            raise ValueError(f"{path}: no duration column and no lengths index, and every epoch is planned from "
                             f"lengths: run `python tools/compute_lengths.py {path}` once (or name the column: "
                             "data.duration_column)")
        self.offsets = np.cumsum([0] + [p.rows for p in self.parts])
        part_of, row_of = [], []
        for p_i, part in enumerate(self.parts):
            if part.ds is None:
                stats.skip("missing_file", part.name, f"parquet file {part.name} does not exist")
                continue
            for r, row in iter_rows(part, with_audio=False):
                try:
                    if part.problem:
                        raise SkipSample("malformed_line", part.problem)
                    rec = row_record(part, r, row, with_audio=False, lengths=self._lengths(p_i, r))
                except SkipSample as e:
                    stats.skip(e.category, f"{part.name} row {r}", e.message)
                    continue
                part_of.append(p_i)
                row_of.append(r)
                if on_record is not None:
                    on_record(rec)
        self.part_of = np.asarray(part_of, np.int32)
        self.row_of = np.asarray(row_of, np.int64)

    def _lengths(self, p_i: int, r: int) -> Optional[np.ndarray]:
        """The index's lengths of a row, [[frames, seconds], ...] (raises its skip), or None."""
        if self.lengths is None:
            return None
        return self.lengths.row(int(self.offsets[p_i] + r))

    def __len__(self) -> int:
        return int(self.row_of.shape[0])

    def record(self, i: int) -> Record:
        p_i, r = int(self.part_of[i]), int(self.row_of[i])
        part = self.parts[p_i]
        row = part.ds[r].to_pylist()[0]
        try:
            return row_record(part, r, row, with_audio=True, lengths=self._lengths(p_i, r))
        except SkipSample as e:   # planned from the same row: cannot happen unless the data changed under us
            return Record(f"{part.name}:{r}", f"{part.name} row {r}", [AudioSpec(path=f"(row {r}: {e.message})")],
                          txt="?")


def write_hf_index(path: str, conf, measure: Callable[[AudioSpec], tuple[int, float]]) -> tuple[int, list[str]]:
    """Measure every row's audio and write the lengths index of ``path`` (west.data.hf_index);
    ``measure(spec)`` gives (fbank frames, seconds). Returns (rows written, problems); the problems
    are in the index too, for the loader to count."""
    parts = open_parts(path, conf)
    problems: list[str] = []

    def lines():
        for part in parts:
            if part.ds is None:
                problems.append(f"{part.name}: [missing_file] does not exist")
                continue
            for r, row in iter_rows(part, with_audio=True):
                try:
                    if part.problem:
                        raise SkipSample("malformed_line", part.problem)
                    yield [list(measure(a)) for a in row_record(part, r, row, with_audio=True).audio]
                except SkipSample as e:
                    problems.append(f"{part.name} row {r}: [{e.category}] {e.message}")
                    yield {"skip": [e.category, e.message]}

    write_lengths(path, parts, lines())
    return sum(p.rows for p in parts), problems
