"""Tar shard indexes: what lets the loader read shards by byte offset.

A WeNet shard list names one uncompressed ``.tar`` per line (``KEY.wav`` +
``KEY.txt`` members). To plan epochs, and so that a rank reads only the
utterances it trains on, west needs each utterance's length and where its audio
lies in its tar. ``tools/make_shard_list.py`` writes that index when it writes
the shards, ``tools/compute_lengths.py`` adds it to existing shard lists; it is
``<shard list>.idx``, JSON lines:

    {"tar": "shards_000000.tar", "bytes": 1048576}                   # one per tar, in list order
    {"key": "BAC009S0002W0122", "offset": 1536, "size": 96044, "ext": "wav",
     "txt": "...", "num_frames": 298, "duration": 3.0}               # its utterances

A problem found while indexing (a missing or unreadable tar, a key without
text or readable audio) is kept in the index as ``"skip": [category, why]``, so
the loader counts it like any bad input.

The tar paths are as the shard list writes them. A tar whose size changed since
it was indexed makes the index stale: an error up front, never wrong audio.
"""
from __future__ import annotations

import json
import os
import tarfile
from typing import Callable, Iterator

from west.data.lists import shard_paths
from west.data.parsing import AUDIO_SUFFIXES, decode_utf8, index_path
from west.data.records import AudioSpec
from west.data.stats import SkipSample


def scan_tar(path: str) -> Iterator[dict]:
    """Every key of an uncompressed tar: ``{key, offset, size, ext, txt}``; ``offset`` or ``txt``
    is None when the member is missing, ``txt`` raw bytes otherwise."""
    group: dict = {}
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            prefix, _, suffix = member.name.rpartition(".")
            if group and prefix != group["key"]:
                yield group
                group = {}
            if not group:
                group = {"key": prefix, "offset": None, "txt": None}
            if suffix == "txt":
                group["txt"] = tar.extractfile(member).read()
            elif suffix in AUDIO_SUFFIXES:
                group.update(offset=member.offset_data, size=member.size, ext=suffix)
    if group:
        yield group


def _index_entry(e: dict, path: str, measure: Callable[[AudioSpec], tuple[int, float]]) -> dict:
    """One utterance's index line; a problem found now is stored as ``skip`` for the loader to count."""
    out = {k: e[k] for k in ("key", "offset", "size", "ext") if k in e}
    try:
        if e["offset"] is None:
            raise SkipSample("missing_file", "shard has no audio member for this key")
        if e["txt"] is None:
            raise SkipSample("empty_text", "shard has no .txt for this key")
        out["txt"] = decode_utf8(e["txt"], "transcript").strip()
        out["num_frames"], out["duration"] = measure(AudioSpec(tar=path, offset=e["offset"], size=e["size"]))
    except SkipSample as err:
        out["skip"] = [err.category, err.message]
    return out


def write_index(shard_list: str, measure: Callable[[AudioSpec], tuple[int, float]]) -> tuple[int, list[str]]:
    """Scan every tar of ``shard_list`` and write its index; ``measure(audio_spec)`` gives
    (num_frames, duration). Problems (a missing or unreadable tar, an utterance without text or
    with unreadable audio) are written into the index, where the loader counts them as skips,
    and returned as messages. Returns (utterances indexed, problems)."""
    n, problems, tmp = 0, [], index_path(shard_list) + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for written, path in shard_paths(shard_list):
            header: dict = {"tar": written, "bytes": os.path.getsize(path) if os.path.exists(path) else -1}
            entries: list[dict] = []
            if header["bytes"] < 0:
                header["skip"] = ["missing_file", f"shard {path} does not exist"]
            else:
                try:
                    entries = list(scan_tar(path))
                except (tarfile.TarError, OSError, EOFError) as e:
                    header["skip"] = ["corrupt_audio", f"unreadable shard (compressed tars cannot be read "
                                                       f"by offset): {e}"]
            if "skip" in header:
                problems.append(f"{written}: [{header['skip'][0]}] {header['skip'][1]}")
            f.write(json.dumps(header, ensure_ascii=False) + "\n")
            for e in entries:
                line = _index_entry(e, path, measure)
                if "skip" in line:
                    problems.append(f"{written}:{line['key']}: [{line['skip'][0]}] {line['skip'][1]}")
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
                n += 1
    os.replace(tmp, index_path(shard_list))
    return n, problems
