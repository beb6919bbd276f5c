"""Cuts that west cannot read as a slice of one file (recording transforms such as speed
perturbation, mixed or padded cuts, url or command sources) are loaded by lhotse itself, at
decode time, from the cut's manifest (``AudioSpec.cut``; the ``lhotse`` extra); so are the
precomputed features of a cut without audio (``AudioSpec.features``: in their own storage, or a
Shar member read by byte offset)."""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from west.data.extras import require
from west.data.stats import SkipSample


def import_lhotse(path: str):
    """The lhotse module, or an error saying that ``path`` needs the lhotse extra."""
    return require("lhotse", path, "a Lhotse manifest")


def load_cut_audio(cut: dict) -> tuple[np.ndarray, int]:
    """(samples, channels) float32 and the rate of a cut that lhotse loads (``AudioSpec.cut``)."""
    import_lhotse("a cut")
    from lhotse.serialization import deserialize_item  # optional extra: lhotse

    missing = [p for p in _file_sources(cut) if not os.path.exists(p)]
    if missing:
        raise SkipSample("missing_file", f"audio file {missing[0]} does not exist")
    obj = deserialize_item(copy.deepcopy(cut))
    try:
        audio = obj.load_audio()
    except Exception as e:   # lhotse wraps what failed; a slice past the audio is the list's fault
        if _caused_by(e, "DurationMismatchError"):
            raise SkipSample("truncated_audio", f"the cut asks for more audio than its recording holds: {e}")
        raise
    return np.ascontiguousarray(np.asarray(audio, np.float32).reshape(-1, audio.shape[-1]).T), obj.sampling_rate


def require_storage(storage: str, what: str) -> None:
    """The package a Lhotse feature storage needs beyond lhotse (``lilcom`` for its compression, in the
    lhotse extra; ``h5py`` for HDF5 files), said up front rather than by a worker mid-epoch."""
    if "lilcom" in storage:
        require("lilcom", what, "lilcom-compressed Lhotse features")
    if "hdf5" in storage:
        require("h5py", what, "Lhotse features in HDF5 files")


def load_cut_features(cut: dict, fmt: str, member: bytes = b"") -> np.ndarray:
    """(T, F) float32 precomputed features of a cut, read by lhotse: from their own storage
    (``fmt`` "manifest"), or from ``member``, the bytes of its Shar features member (``fmt``
    "llc" or "npy", filled in as lhotse's own Shar reader fills its placeholder)."""
    import_lhotse("a cut's features")
    from lhotse.serialization import deserialize_item  # optional extra: lhotse
    from lhotse.shar.utils import fill_shar_placeholder  # optional extra: lhotse

    obj = deserialize_item(copy.deepcopy(cut))
    if fmt != "manifest":
        fill_shar_placeholder(obj, member, Path(f"{obj.id}.{fmt}"), field="features")
    elif not obj.features.storage_type.startswith("memory"):
        where = Path(obj.features.storage_path)
        where = where / obj.features.storage_key if obj.features.storage_type.endswith("_files") else where
        if not where.exists():
            raise SkipSample("missing_file", f"feature file {where} does not exist")
    try:
        mat = obj.load_features()
    except Exception as e:   # a truncated or corrupt member is bad input, not a reason to stop the epoch
        raise SkipSample("corrupt_audio", f"cannot read the features of cut {obj.id}: {type(e).__name__}: {e}")
    return np.ascontiguousarray(np.asarray(mat, np.float32))


def _file_sources(item: object) -> Iterator[str]:
    if isinstance(item, dict):
        if item.get("type") == "file" and isinstance(item.get("source"), str):
            yield item["source"]
        for v in item.values():
            yield from _file_sources(v)
    elif isinstance(item, list):
        for v in item:
            yield from _file_sources(v)


def _caused_by(e: BaseException, name: str) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if type(e).__name__ == name or name in str(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False
