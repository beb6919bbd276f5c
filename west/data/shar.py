"""Lhotse Shar directories (the ``lhotse`` extra), read by byte offset through an index.

A Shar directory holds shards ``cuts.NNNNNN.jsonl.gz`` + ``recording.NNNNNN.tar``: the tar has,
for each cut of its cuts file and in the same order, the cut's audio (``ID.flac``, ``ID.wav``...)
followed by its recording manifest (``ID.json``; ``ID.nodata`` + ``ID.nometa`` for a cut without
audio). A shard without a recording tar is read from its ``features.NNNNNN.tar`` instead: each
cut's precomputed features (``ID.llc`` lilcom or ``ID.npy``), decoded by lhotse at load time. To
plan epochs every cut's length is needed (its duration, in the cuts file), and so that a rank reads
only the audio it trains on, where each cut's audio lies in its tar: that is the
index ``tools/compute_lengths.py SHAR_DIR`` writes once, ``SHAR_DIR.west.idx`` beside it, JSON lines:

    {"cuts": "cuts.000000.jsonl.gz", "tar": "recording.000000.tar", "bytes": 1048576}   # one per shard
    {"key": "cut-0001", "offset": 1536, "size": 96044}                                  # its cuts, in order

A problem found while indexing (a missing or unreadable tar, a cut without audio, a member that is
not the cut's) is kept as ``"skip": [category, why]`` for the loader to count. A tar whose size
changed, or a cuts file that no longer matches the index, makes the index stale: an error up front,
never wrong audio. The epoch is planned over all cuts of all shards like any list; each rank reads
its own cuts' members by offset.
"""
from __future__ import annotations

import json
import os
import re
import tarfile
from typing import Callable, Optional

from west.data.lhotse_audio import import_lhotse
from west.data.lhotse_lists import PickledRecords, _as_cut, cut_features, cut_record, read_manifest
from west.data.parsing import index_path, read_lines
from west.data.records import AudioSpec, Record
from west.data.stats import DataStats, SkipSample

SHARD_RE = re.compile(r"^cuts\.(\d+)\.jsonl(\.gz)?$")


def shar_shards(path: str) -> list[tuple[str, str]]:
    """(cuts file, data tar) names of every shard of a Shar directory, in shard order: its recording
    tar, or where the shard has none, its features tar (precomputed Lhotse features)."""
    names = set(os.listdir(path))
    out = []
    for n in names:
        m = SHARD_RE.match(n)
        if m is not None:
            audio, feats = f"recording.{m.group(1)}.tar", f"features.{m.group(1)}.tar"
            out.append((n, feats if audio not in names and feats in names else audio))
    return sorted(out)


def is_features_tar(name: str) -> bool:
    """The shard's data tar holds precomputed features, not audio."""
    return name.startswith("features.")


def _data_members(tar_path: str) -> list[tuple[str, int, int]]:
    """(name, offset, size) of each cut's data member (every other member: the manifests follow them)."""
    with tarfile.open(tar_path, mode="r:") as tar:
        return [(m.name, m.offset_data, m.size) for i, m in enumerate(tar) if i % 2 == 0]


def _entry(key: Optional[str], member: Optional[tuple[str, int, int]], tar_name: str) -> dict:
    out: dict = {"key": key}
    if member is None:
        out["skip"] = ["missing_file", f"{tar_name} has no member for this cut"]
    elif member[0].rpartition(".")[0] != key:
        out["skip"] = ["corrupt_audio", f"{tar_name} holds {member[0]} where this cut's audio should be"]
    elif member[0].endswith(".nodata"):
        what = "features" if is_features_tar(tar_name) else "audio"
        out["skip"] = ["missing_file", f"the Shar holds no {what} for this cut"]
    else:
        out.update(offset=member[1], size=member[2])
        if is_features_tar(tar_name):
            out["format"] = member[0].rpartition(".")[2]
            if out["format"] not in ("llc", "npy"):
                out = {"key": key, "skip": ["corrupt_audio", f"{tar_name}: {member[0]} is not lilcom (.llc) or numpy "
                                                             "(.npy) features"]}
    return out


def write_shar_index(path: str) -> tuple[int, list[str]]:
    """Scan every shard of the Shar directory ``path`` and write ``index_path(path)``.
    Returns (cuts indexed, problems); the problems are in the index too, for the loader to count."""
    shards = shar_shards(path)
    if not shards:
        raise ValueError(f"{path}: no cuts.NNNNNN.jsonl.gz in this directory (not a Lhotse Shar)")
    n, problems, out = 0, [], index_path(path)
    tmp = out + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for cuts_name, tar_name in shards:
            keys = [obj.get("id") if isinstance(obj, dict) else None
                    for _, obj in read_manifest(os.path.join(path, cuts_name))]
            tar = os.path.join(path, tar_name)
            header: dict = {"cuts": cuts_name, "tar": tar_name, "bytes": os.path.getsize(tar) if os.path.exists(tar) else -1}
            members: list = []
            if header["bytes"] < 0:
                header["skip"] = ["missing_file", f"{tar} does not exist"]
            else:
                try:
                    members = _data_members(tar)
                except (tarfile.TarError, OSError, EOFError) as e:
                    header["skip"] = ["corrupt_audio", f"unreadable {tar} (Shar tars must be uncompressed): {e}"]
            if "skip" in header:
                problems.append(f"{tar_name}: [{header['skip'][0]}] {header['skip'][1]}")
            f.write(json.dumps(header, ensure_ascii=False) + "\n")
            for i, key in enumerate(keys):
                entry = ({"key": key, "skip": header["skip"]} if "skip" in header
                         else _entry(key, members[i] if i < len(members) else None, tar_name))
                if "skip" in entry and "skip" not in header:
                    problems.append(f"{cuts_name}:{key}: [{entry['skip'][0]}] {entry['skip'][1]}")
                f.write(json.dumps(entry, ensure_ascii=False) + "\n")
                n += 1
    os.replace(tmp, out)
    return n, problems


def _read_index(path: str) -> list[tuple[dict, list[dict]]]:
    idx = index_path(path)
    if not os.path.exists(idx):
        raise ValueError(f"{path}: a Lhotse Shar directory without its index {idx}; run "
                         f"`python tools/compute_lengths.py {path}` once to write it")
    groups: list[tuple[dict, list[dict]]] = []
    for _, raw in read_lines(idx):
        obj = json.loads(raw)
        if "cuts" in obj:
            groups.append((obj, []))
        else:
            groups[-1][1].append(obj)
    return groups


class SharList(PickledRecords):
    """A Shar directory read through its index: one record per cut, audio read by offset."""

    def __init__(self, path: str, stats: DataStats, on_record: Optional[Callable[[Record], None]] = None):
        super().__init__(path)
        import_lhotse(path)
        from lhotse.serialization import deserialize_item  # optional extra: lhotse

        stale = f"; rerun `python tools/compute_lengths.py {path}`"
        groups = _read_index(path)
        if [h["cuts"] for h, _ in groups] != [c for c, _ in shar_shards(path)]:
            raise ValueError(f"{index_path(path)} does not list this directory's cuts files: the index is stale{stale}")
        for header, entries in groups:
            tar, cuts_path = os.path.join(path, header["tar"]), os.path.join(path, header["cuts"])
            if header["bytes"] >= 0 and os.path.exists(tar) and os.path.getsize(tar) != header["bytes"]:
                raise ValueError(f"{tar} changed since {index_path(path)} was written{stale}")
            items = list(read_manifest(cuts_path))
            if len(items) != len(entries):
                raise ValueError(f"{cuts_path} has {len(items)} cuts, the index {len(entries)}: it is stale{stale}")
            for (lineno, obj), entry in zip(items, entries):
                src = f"{cuts_path}:{lineno}"
                try:
                    if isinstance(obj, SkipSample):
                        raise obj
                    cut = _shar_cut(deserialize_item, obj)
                    if cut.id != entry["key"]:
                        raise ValueError(f"{src}: cut {cut.id}, the index has {entry['key']}: it is stale{stale}")
                    if "skip" in entry:
                        raise SkipSample(*entry["skip"])
                    if is_features_tar(header["tar"]):
                        audio = cut_features(cut, path, entry["format"])
                        audio.tar, audio.offset, audio.size = tar, entry["offset"], entry["size"]
                    else:
                        n = len(cut.channel) if isinstance(cut.channel, list) else 1
                        audio = AudioSpec(tar=tar, offset=entry["offset"], size=entry["size"], start=0.0,
                                          end=float(cut.duration), duration=float(cut.duration),
                                          channels=tuple(range(n)) if n > 1 else None)
                    self.keep(cut_record(cut, src, path, audio), on_record)
                except SkipSample as e:
                    stats.skip(e.category, src, e.message)


def _shar_cut(deserialize_item, obj: object):
    from lhotse import MonoCut, MultiCut  # optional extra: lhotse

    if not isinstance(obj, dict):
        raise SkipSample("malformed_line", "line is not a JSON object (a Lhotse cut)")
    try:
        cut = _as_cut(deserialize_item(obj))
    except Exception as e:   # lhotse raises KeyError, TypeError, ValueError, AssertionError...
        raise SkipSample("malformed_line", f"not a Lhotse cut: {type(e).__name__}: {e}")
    if not isinstance(cut, (MonoCut, MultiCut)):
        raise SkipSample("malformed_line", f"a {type(cut).__name__} in a Shar (west reads mono and multi-channel cuts)")
    return cut
