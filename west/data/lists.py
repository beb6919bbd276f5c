"""Data lists: turn every input format into one record shape (west.data.records.Record:
key, source line, audio parts, and a transcript or a role-content conversation).

Formats: jsonl utterances (``key``/``wav``/``txt``, optional ``duration``,
``num_frames``, ``start``/``end``), jsonl role-content ``messages``, tar shard
lists (one ``.tar`` per line, read by offset through the index that
``west.data.shards`` writes beside the list) and Kaldi ``feats.scp`` + ``text``
(+ ``utt2num_frames``). Every record names its source file and line so a skip
warning can point at it. ``open_list`` is the one dispatch from a path to its
source (``len()``, ``record(i)``).
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterator, Optional, Union

from west.data.records import AudioSpec, Message, Record
from west.data.stats import DataStats, SkipSample

AUDIO_SUFFIXES = ("wav", "flac", "mp3", "ogg", "opus", "sph")
ROLES = ("system", "user", "assistant")


def read_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of every non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield lineno, raw


def decode_utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SkipSample("bad_encoding", f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})")


def check_text(text: object, what: str) -> str:
    """A transcript must be a non-blank string encodable as UTF-8."""
    if not isinstance(text, str):
        raise SkipSample("malformed_line", f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SkipSample("bad_encoding", f"{what} holds invalid unicode (lone surrogate)")
    if not text.strip():
        raise SkipSample("empty_text", f"{what} is empty or whitespace")
    return text


def _num(obj: dict, name: str, cast, what: str):
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise SkipSample("malformed_line", f"{what}: {name!r} must be a non-negative number, got {v!r}")
    return cast(v)


def _audio_spec(obj: dict, path: object, base: str, what: str) -> AudioSpec:
    if not isinstance(path, str) or not path:
        raise SkipSample("malformed_line", f"{what}: audio path must be a non-empty string")
    spec = AudioSpec(path=path, base=base, start=_num(obj, "start", float, what), end=_num(obj, "end", float, what),
                     duration=_num(obj, "duration", float, what), num_frames=_num(obj, "num_frames", int, what))
    if spec.start is not None and spec.end is not None and spec.end <= spec.start:
        raise SkipSample("empty_audio", f"{what}: segment end {spec.end} <= start {spec.start}")
    return spec


def _parse_messages(msgs: object, base: str) -> tuple[list[Message], list[AudioSpec]]:
    if not isinstance(msgs, list) or not msgs:
        raise SkipSample("malformed_line", "'messages' must be a non-empty list")
    out, audio, n_assistant = [], [], 0
    for m_i, msg in enumerate(msgs):
        what = f"messages[{m_i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ROLES or "content" not in msg:
            raise SkipSample("malformed_line", f"{what} needs a role in {ROLES} and a content")
        content = msg["content"]
        items = content if isinstance(content, list) else [content]
        parts = []
        for item in items:
            if isinstance(item, str):
                parts.append(("text", item))
            elif isinstance(item, dict) and item.get("type") == "text":
                if not isinstance(item.get("text"), str):
                    raise SkipSample("malformed_line", f"{what}: a text part needs a string 'text'")
                parts.append(("text", item["text"]))
            elif isinstance(item, dict) and item.get("type") == "audio":
                if msg["role"] == "assistant":
                    raise SkipSample("malformed_line", f"{what}: assistant turns cannot hold audio")
                parts.append(("audio", len(audio)))
                audio.append(_audio_spec(item, item.get("audio"), base, what))
            else:
                raise SkipSample("malformed_line", f"{what}: content part {item!r:.60} is not text or audio")
        if msg["role"] == "assistant":
            n_assistant += 1
            check_text("".join(t for k, t in parts if k == "text"), f"{what} (assistant)")
        out.append(Message(msg["role"], parts))
    if not n_assistant:
        raise SkipSample("empty_text", "conversation has no assistant turn to learn from")
    return out, audio


def parse_json_record(raw: bytes, src: str, base: str) -> Record:
    """One jsonl line -> record; raises SkipSample naming what is wrong."""
    line = decode_utf8(raw, "line")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise SkipSample("malformed_line", f"invalid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        raise SkipSample("malformed_line", "line is not a JSON object")
    key = obj.get("key", src)
    if not isinstance(key, str) or not key:
        raise SkipSample("malformed_line", "'key' must be a non-empty string")
    if "messages" in obj:
        messages, audio = _parse_messages(obj["messages"], base)
        return Record(key, src, audio, messages=messages)
    if "wav" not in obj:
        raise SkipSample("malformed_line", "needs 'wav' and 'txt' (or 'messages')")
    txt = check_text(obj.get("txt", obj.get("text")), "'txt'")
    return Record(key, src, [_audio_spec(obj, obj["wav"], base, "line")], txt=txt)


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
INDEX_SUFFIX = ".idx"


def index_path(shard_list: str) -> str:
    return shard_list + INDEX_SUFFIX


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
Source = Union[RawList, KaldiList, ShardList]  # one list format: len(), record(i)
SOURCES = {"raw": RawList, "kaldi": KaldiList, "shard": ShardList}


def detect_data_type(path: str) -> str:
    """raw | shard | kaldi, from the path and the first non-blank line."""
    if os.path.isdir(path) or path.endswith(".scp"):
        return "kaldi"
    for _, raw in read_lines(path):
        return "shard" if raw.strip().endswith((b".tar", b".tar.gz", b".tgz")) else "raw"
    return "raw"


def open_list(path: str, stats: DataStats, data_type: str = "auto",
              on_record: Optional[Callable[[Record], None]] = None) -> Source:
    """The source for ``path`` (``data_type`` auto detects it)."""
    kind = detect_data_type(path) if data_type == "auto" else data_type
    return SOURCES[kind](path, stats, on_record)


def iter_records(path: str, stats: DataStats, data_type: str = "auto") -> Iterator[Record]:
    """Every record of any list format, in list order (decoding, CMVN, statistics)."""
    source = open_list(path, stats, data_type)
    for i in range(len(source)):
        yield source.record(i)
