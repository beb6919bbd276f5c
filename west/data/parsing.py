"""What one list line or item says, checked: the parsing every list kind shares (jsonl lines,
role-content conversations, transcripts, Lhotse manifest lines) and where west keeps an index
beside a list. A problem is a ``SkipSample`` naming its category; the list kind counts it with
the file and line.
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Callable, Iterator, Optional

from west.data.records import AudioSpec, Message, Record
from west.data.stats import SkipSample

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


def parse_messages(msgs: object, base: str, cell: Optional[Callable[[str], AudioSpec]] = None
                   ) -> tuple[list[Message], list[AudioSpec]]:
    """Role-content turns -> messages and their audio parts; an audio part without a path stands for
    the row's own audio, ``cell(what)`` (a dataset's audio column, a cut's audio), where there is one."""
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
                own = cell is not None and item.get("audio") is None
                audio.append(cell(what) if own else _audio_spec(item, item.get("audio"), base, what))
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
        messages, audio = parse_messages(obj["messages"], base)
        return Record(key, src, audio, messages=messages)
    if "wav" not in obj:
        raise SkipSample("malformed_line", "needs 'wav' and 'txt' (or 'messages')")
    txt = check_text(obj.get("txt", obj.get("text")), "'txt'")
    return Record(key, src, [_audio_spec(obj, obj["wav"], base, "line")], txt=txt)


INDEX_SUFFIX = ".idx"


def index_path(path: str) -> str:
    """Where west keeps what it needs beside a list: LIST.idx, or DIR.west.idx beside a directory (never
    inside it: lhotse reads every file of a Shar directory as one of its fields)."""
    return os.path.normpath(path) + ".west" + INDEX_SUFFIX if os.path.isdir(path) else path + INDEX_SUFFIX


def first_json(path: str) -> object:
    """The first line of a (gzipped) JSON-lines file, parsed; None if it is not JSON."""
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            for raw in f:
                if raw.strip():
                    return json.loads(raw)
    except (OSError, EOFError, ValueError):
        return None
    return None


def is_lhotse_item(obj: object) -> bool:
    """A Lhotse cut, recording or supervision, as its manifest line has it."""
    if not isinstance(obj, dict):
        return False
    return (obj.get("type") in ("MonoCut", "MultiCut", "MixedCut", "PaddingCut") or "supervisions" in obj
            or ("sources" in obj and "sampling_rate" in obj) or ("recording_id" in obj and "duration" in obj))
