"""A checksum of every byte of every checkpoint file, so damaged bytes are never resumed from.

The structural checks (west.checkpoint.integrity) catch a truncated file or broken JSON, but a
flipped bit inside a tensor leaves a file that parses: it loads silently, with wrong weights,
or NaN in the optimizer state a step later. So the save records, in ``checksums.json``, the
size and CRC-32 of each file of the step dir (``meta.json`` included), right after they were
written; a resume verifies them before use.

CRC-32 (zlib) detects every burst of damage up to 32 bits and is the fastest check at hand
(about 7 GB/s on one core here, against 1.4 GB/s for blake2b and 2.1 GB/s for sha256): damage,
not an attacker, is what it guards against. A step dir without ``checksums.json`` (written
before the rule) is verified structurally only.
"""
from __future__ import annotations

import json
import mmap
import os
import zlib
from pathlib import Path
from typing import Optional

from west.checkpoint import files

CHECKSUMS = "checksums.json"
ALGORITHM = "crc32"
CHUNK = 64 << 20

# Step dirs verified whole in this process, by the (size, mtime, inode) of each file: resume
# verifies the newest, then loads it; the load does not read every byte twice.
_verified: dict[str, tuple] = {}


def crc32_file(path: Path) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of the file at ``path``: mapped, hashed in chunks
    without a copy (7 GB/s from the page cache here, against 5.7 for reads into a buffer)."""
    crc = 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    for i in range(0, size, CHUNK):
                        crc = zlib.crc32(view[i:i + CHUNK], crc)
                finally:
                    view.release()
    return size, f"{crc & 0xFFFFFFFF:08x}"


def _listed(step: Path) -> list[Path]:
    return sorted(p for p in step.rglob("*") if p.is_file() and p.relative_to(step).as_posix() != CHECKSUMS)


def record(step: Path) -> None:
    """Write ``step/checksums.json``: size and CRC-32 of every other file under ``step`` (fsynced)."""
    entries = {}
    for p in _listed(step):
        size, crc = crc32_file(p)
        entries[p.relative_to(step).as_posix()] = {"bytes": size, ALGORITHM: crc}
    files.save_json({"algorithm": ALGORITHM, "files": entries}, step / CHECKSUMS)


def _stamp(step: Path, names: list[str]) -> tuple:
    stats = [(n, os.stat(step / n)) for n in names]
    return tuple((n, s.st_size, s.st_mtime_ns, s.st_ino) for n, s in stats)


def verify(step: str | os.PathLike) -> Optional[str]:
    """Why the files of ``step`` differ from its ``checksums.json`` (naming the first damaged,
    missing or unlisted file), or None: all match, or the dir predates checksums."""
    step = Path(step)
    table = step / CHECKSUMS
    if not table.is_file():
        return None
    try:
        recorded = json.loads(table.read_text(encoding="utf-8"))
        entries = recorded["files"]
        if recorded.get("algorithm") != ALGORITHM or not isinstance(entries, dict):
            raise ValueError(f"algorithm {recorded.get('algorithm')!r}, expected {ALGORITHM!r}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{CHECKSUMS}: unreadable ({e})"
    present = {p.relative_to(step).as_posix() for p in _listed(step)}
    missing, unlisted = sorted(set(entries) - present), sorted(present - set(entries))
    if missing:
        return f"{missing[0]}: listed in {CHECKSUMS} but missing"
    if unlisted:
        return f"{unlisted[0]}: not listed in {CHECKSUMS} (added or renamed after the save)"
    names = sorted(entries)
    key = str(step.resolve())
    stamp = _stamp(step, names)
    if _verified.get(key) == stamp:
        return None
    for name in names:
        want = entries[name]
        size, crc = crc32_file(step / name)
        if not isinstance(want, dict) or want.get("bytes") != size or want.get(ALGORITHM) != crc:
            got = f"{size} bytes, {ALGORITHM} {crc}"
            return (f"{name}: checksum mismatch (recorded {want.get('bytes') if isinstance(want, dict) else '?'} "
                    f"bytes, {ALGORITHM} {want.get(ALGORITHM) if isinstance(want, dict) else '?'}; read {got}): "
                    "damaged bytes")
    _verified[key] = stamp
    return None
