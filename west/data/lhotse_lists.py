"""Lhotse manifests as data lists (the ``lhotse`` extra): a CutSet (``cuts*.jsonl.gz``), a
recordings + supervisions pair, and Shar directories (``west.data.shar``).

Each cut becomes one Record: its audio is the cut's slice of its recording (start, duration,
channel), its transcript the texts of all its supervisions in time order joined by a space (one
sample per cut, as the cut's author cut it; ``CutSet.trim_to_supervisions()`` gives one per
supervision). A recordings + supervisions pair has no cuts: each supervision is one sample, the
slice of its recording it covers. A cut whose ``custom`` holds ``messages`` is a conversation
(as in jsonl; an audio part without a path is the cut's audio).

West decodes a plain cut itself (a file's slice by seeking, channels picked; the same code as a
jsonl segment). A cut it cannot read that way (recording transforms such as speed perturbation,
a mixed or padded cut, a url or command source) keeps its manifest and lhotse loads it at decode
time (``AudioSpec.cut``). Lengths come from the cut's duration; no audio is read to plan.

Records are kept pickled (one bytes object per cut), like the raw lines of a jsonl list.
"""
from __future__ import annotations

import copy
import gzip
import json
import os
import pickle
from typing import Callable, Iterator, Optional

from west.data.features import SEGMENT_END_TOLERANCE_S, resolve_path
from west.data.lhotse_audio import import_lhotse, require_storage
from west.data.parsing import check_text, is_lhotse_item, parse_messages
from west.data.records import AudioSpec, Record
from west.data.stats import DataStats, SkipSample


def read_manifest(path: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON or SkipSample) of every non-blank line of a (gzipped) JSON-lines file."""
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield lineno, json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                yield lineno, SkipSample("malformed_line", f"invalid JSON ({e})")


def _channels(cut) -> list[int]:
    return [cut.channel] if isinstance(cut.channel, int) else list(cut.channel)


def _file_spec(cut, base: str) -> Optional[AudioSpec]:
    """The cut as a slice of one audio file west reads itself, or None (lhotse must load it)."""
    from lhotse import MonoCut, MultiCut  # optional extra: lhotse

    rec = cut.recording if isinstance(cut, (MonoCut, MultiCut)) else None
    if rec is None or rec.transforms:
        return None
    chans = _channels(cut)
    sources = [s for s in rec.sources if set(chans) & set(s.channels)]
    if len(sources) != 1 or not set(chans) <= set(sources[0].channels) or sources[0].type not in ("file", "memory"):
        return None
    src = sources[0]
    cols = tuple(src.channels.index(c) for c in chans)
    spec = AudioSpec(start=float(cut.start), end=float(cut.start + cut.duration), duration=float(cut.duration),
                     channels=None if cols == (0,) else cols)
    if src.type == "file":
        spec.path, spec.base = src.source, base
    else:
        spec.data = bytes(src.source)
    return spec


def _resolved(item: object, base: str) -> object:
    """A cut's dict with every file source's path resolved as west resolves list paths."""
    if isinstance(item, dict):
        if item.get("type") == "file" and isinstance(item.get("source"), str):
            return {**item, "source": resolve_path(item["source"], base)}
        return {k: _resolved(v, base) for k, v in item.items()}
    if isinstance(item, list):
        return [_resolved(v, base) for v in item]
    return item


def cut_features(cut, base: str, fmt: str = "manifest") -> AudioSpec:
    """A cut without audio read by its precomputed features (their own storage, or a Shar member's
    format ``fmt``); the package its storage needs is checked here, before any epoch."""
    require_storage("lilcom" if fmt == "llc" else cut.features.storage_type, f"cut {cut.id}")
    item = _resolved(cut.to_dict(), base)
    feats = item["features"]
    if fmt == "manifest" and feats.get("storage_path") and not feats["storage_type"].startswith("memory"):
        feats["storage_path"] = resolve_path(feats["storage_path"], base)   # as west resolves list paths
    return AudioSpec(cut=item, features=fmt, duration=float(cut.duration), num_frames=int(cut.num_frames))


def cut_audio(cut, base: str) -> AudioSpec:
    """Where a cut's audio is, else its precomputed features (raises SkipSample for a cut with
    neither, or past its recording)."""
    if not cut.has_recording:
        if cut.has_features:
            return cut_features(cut, base)
        raise SkipSample("missing_file", f"cut {cut.id} has no recording and no features")
    rec = getattr(cut, "recording", None)
    if rec is not None and cut.start + cut.duration > rec.duration + SEGMENT_END_TOLERANCE_S:
        raise SkipSample("truncated_audio", f"cut ends at {cut.start + cut.duration:.3f}s, past the end of "
                                            f"recording {rec.id} ({rec.duration:.3f}s)")
    spec = _file_spec(cut, base)
    if spec is not None:
        return spec
    n = len(_channels(cut)) if hasattr(cut, "channel") else 1
    return AudioSpec(cut=_resolved(cut.to_dict(), base), duration=float(cut.duration),
                     channels=tuple(range(n)) if n > 1 else None)


def cut_record(cut, src: str, base: str, audio: Optional[AudioSpec] = None) -> Record:
    """One cut -> one record (``audio``: where its audio is, if not in its recording: Shar)."""
    spec = audio if audio is not None else cut_audio(cut, base)
    messages = (getattr(cut, "custom", None) or {}).get("messages")
    if messages is not None:
        msgs, parts = parse_messages(messages, base, cell=lambda what: copy.copy(spec))
        return Record(cut.id, src, parts, messages=msgs)
    texts = [s.text.strip() for s in sorted(cut.supervisions, key=lambda s: s.start)
             if isinstance(s.text, str) and s.text.strip()]
    return Record(cut.id, src, [spec], txt=check_text(" ".join(texts), "the cut's supervision text"))


class PickledRecords:
    """Records kept as one pickled bytes object each (compact; workers share them on fork). The bytes
    are only ever this process's own ``pickle.dumps`` of a Record built from the manifest, never read
    from a file, so unpickling them runs nothing a manifest could inject."""

    def __init__(self, path: str):
        self.path = path
        self.items: list[bytes] = []

    def keep(self, rec: Record, on_record: Optional[Callable[[Record], None]]) -> None:
        self.items.append(pickle.dumps(rec, protocol=pickle.HIGHEST_PROTOCOL))
        if on_record is not None:
            on_record(rec)

    def __len__(self) -> int:
        return len(self.items)

    def record(self, i: int) -> Record:
        return pickle.loads(self.items[i])


class LhotseList(PickledRecords):
    """A CutSet manifest, or a recordings + supervisions pair (either file may be given)."""

    def __init__(self, path: str, stats: DataStats, on_record: Optional[Callable[[Record], None]] = None):
        super().__init__(path)
        import_lhotse(path)
        from lhotse.serialization import deserialize_item  # optional extra: lhotse

        first = next((obj for _, obj in read_manifest(path) if isinstance(obj, dict)), None)
        if first is not None and not is_lhotse_item(first):
            raise ValueError(f"{path}: not a Lhotse manifest (its first item has keys {sorted(first)[:6]})")
        if first is not None and ("recording_id" in first or "sources" in first):
            self._pair(path, first, stats, on_record)
            return
        base = os.path.dirname(os.path.abspath(path))
        for lineno, obj in read_manifest(path):
            src = f"{path}:{lineno}"
            try:
                if isinstance(obj, SkipSample):
                    raise obj
                cut = _parse(lambda d: _as_cut(deserialize_item(d)), obj, "cut")
                self.keep(cut_record(cut, src, base), on_record)
            except SkipSample as e:
                stats.skip(e.category, src, e.message)

    def _pair(self, path: str, first: dict, stats: DataStats, on_record) -> None:
        """One sample per supervision: the slice of its recording it covers."""
        from lhotse import MonoCut, MultiCut, Recording, SupervisionSegment, fastcopy  # optional extra: lhotse

        recs_path, sups_path = partner_manifests(path, "recording_id" in first)
        base = os.path.dirname(os.path.abspath(recs_path))
        recordings = {}
        for lineno, obj in read_manifest(recs_path):
            try:
                if isinstance(obj, SkipSample):
                    raise obj
                rec = _parse(Recording.from_dict, obj, "recording")
                recordings[rec.id] = rec
            except SkipSample as e:
                stats.skip(e.category, f"{recs_path}:{lineno}", e.message)
        for lineno, obj in read_manifest(sups_path):
            src = f"{sups_path}:{lineno}"
            try:
                if isinstance(obj, SkipSample):
                    raise obj
                sup = _parse(SupervisionSegment.from_dict, obj, "supervision")
                rec = recordings.get(sup.recording_id)
                if rec is None:
                    raise SkipSample("missing_file", f"recording {sup.recording_id} is not in {recs_path}")
                kind = MonoCut if isinstance(sup.channel, int) else MultiCut
                cut = kind(id=sup.id, start=sup.start, duration=sup.duration, channel=sup.channel, recording=rec,
                           supervisions=[fastcopy(sup, start=0)], custom=sup.custom)
                self.keep(cut_record(cut, src, base), on_record)
            except SkipSample as e:
                stats.skip(e.category, src, e.message)


def partner_manifests(path: str, is_supervisions: bool) -> tuple[str, str]:
    """(recordings, supervisions) manifests of a pair, from either one's path (names differ only there)."""
    head, name = os.path.split(path)
    mine, other = ("supervisions", "recordings") if is_supervisions else ("recordings", "supervisions")
    if mine not in name:
        raise ValueError(f"{path}: a Lhotse {mine} manifest whose name lacks '{mine}': give the cuts "
                         f"(CutSet.from_manifests(...).to_file('cuts.jsonl.gz')) or name the pair "
                         f"*recordings*.jsonl.gz / *supervisions*.jsonl.gz")
    i = name.rindex(mine)
    partner = os.path.join(head, name[:i] + other + name[i + len(mine):])
    if not os.path.exists(partner):
        raise ValueError(f"{path}: its {other} manifest {partner} does not exist")
    return (partner, path) if is_supervisions else (path, partner)


def _parse(parse, obj: object, what: str):
    """A manifest item -> lhotse object (which may consume ``obj``); anything lhotse refuses is a
    malformed line."""
    if not isinstance(obj, dict):
        raise SkipSample("malformed_line", f"line is not a JSON object (a Lhotse {what})")
    try:
        return parse(obj)
    except Exception as e:   # lhotse raises KeyError, TypeError, ValueError, AssertionError...
        raise SkipSample("malformed_line", f"not a Lhotse {what}: {type(e).__name__}: {e}")


def _as_cut(item):
    from lhotse.cut import Cut  # optional extra: lhotse

    if not isinstance(item, Cut):
        raise ValueError(f"a {type(item).__name__} in a cut manifest")
    return item
