"""Which checkpoint to resume from: the newest ``step_*`` dir whose files are whole.

A ``step_*`` dir appears only after its files were fsynced (west.checkpoint.training), but a
filesystem that loses writes in a crash, a copy cut short or a hand edit can still leave a
truncated file or bad JSON in one. Resuming from it must not happen silently: the newest
checkpoint that passes is used and each newer one is reported (``latest_usable``).

Read: meta.json and every ``*.json`` (parsed), every ``*.safetensors`` (header and the length
it announces: a truncated file fails), every ``*.pt`` (its zip directory, at the end of the
file: a truncated file fails), then every byte of every file against the CRC-32 recorded in
``checksums.json`` at the save (west.checkpoint.checksums): a flipped bit fails too.
"""
from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path
from typing import Callable, Optional

from west.checkpoint.checksums import verify

PREFIX = "step_"        # DIR/checkpoints/step_00001234
SET_ASIDE = ".corrupt"  # suffix of a step dir that failed the checks: no longer a checkpoint name
REQUIRED = ("model.safetensors", "optimizer.pt", "scheduler.pt")


def _json_problem(path: Path) -> Optional[str]:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{path.name}: {e}"
    return None


def _safetensors_problem(path: Path) -> Optional[str]:
    from safetensors import safe_open  # heavy

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as e:  # SafetensorError (header too small, file not fully covered...) or OSError
        return f"{path.name}: {e}"
    return None


def _pt_problem(path: Path) -> Optional[str]:
    try:
        with zipfile.ZipFile(path) as z:  # torch.save writes a zip; its directory is the last thing written
            z.namelist()
    except (OSError, zipfile.BadZipFile) as e:
        return f"{path.name}: {e} (truncated?)"
    return None


def read_checked_meta(path: Path) -> tuple[Optional[str], dict]:
    """(why meta.json is unusable or None, its content): an object with integer step and world_size."""
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        return "no meta.json", {}
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"meta.json: {e}", {}
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) \
            or not isinstance(meta.get("world_size"), int) or meta["world_size"] < 1:
        return "meta.json: no integer step and world_size", {}
    digits = path.name.rpartition("_")[2]
    if digits.isdigit() and int(digits) != meta["step"]:
        return f"meta.json: step {meta['step']} in a dir named {path.name}", {}
    return None, meta


def check_checkpoint(path: str | os.PathLike) -> Optional[str]:
    """Why ``path`` cannot be resumed from (the first missing, truncated, unreadable or damaged
    file), or None."""
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    problem, meta = read_checked_meta(path)
    if problem:
        return problem
    world = meta["world_size"]
    need = [*REQUIRED, *(f"rng_rank{r}.pt" for r in range(world))]
    missing = [n for n in need if not (path / n).is_file()]
    missing += [f"data_rank{r}.json" for r in range(world)
                if not ((path / f"data_rank{r}.json").is_file() or (path / f"data_rank{r}.pt").is_file())]
    if missing:
        return f"missing {', '.join(missing)}"
    files = sorted(p for p in path.rglob("*") if p.is_file())
    checks = {".json": _json_problem, ".safetensors": _safetensors_problem, ".pt": _pt_problem}
    for f in files:
        check = checks.get(f.suffix) if f != path / "meta.json" else None  # read above
        problem = check(f) if check else None
        if problem:
            return problem if f.parent == path else f"{f.parent.name}/{problem}"
    return verify(path)


def _warn(text: str) -> None:
    print(f"WARNING: {text}", file=sys.stderr, flush=True)


def latest_usable(root: str | os.PathLike) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """The newest ``step_*`` dir that passes ``check_checkpoint``, and each newer one that does
    not, with why (a dir without meta.json included: it may have lost it)."""
    root = Path(root)
    dirs = sorted((int(p.name[len(PREFIX):]), p) for p in (root.iterdir() if root.is_dir() else ())
                  if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit())
    bad = []
    for _, p in reversed(dirs):
        problem = check_checkpoint(p)
        if problem is None:
            return p, bad
        bad.append((p, problem))
    return None, bad


def find_latest(root: str | os.PathLike, warn: Optional[Callable[[str], None]] = _warn) -> Optional[Path]:
    """The newest usable checkpoint under ``root`` (None: none); each newer dir that is not
    usable goes to ``warn`` (default: stderr), so a fallback is never silent."""
    latest, bad = latest_usable(root)
    for p, problem in bad if warn else ():
        warn(f"checkpoint {p} is not usable ({problem}); "
             f"{'falling back to ' + str(latest) if latest else 'no older one to fall back to'}")
    return latest


def set_aside(path: Path) -> Path:
    """Rename a dir that failed the checks to ``step_N.corrupt`` (kept for inspection): it is no
    longer listed, pruned or counted in keep_last, and this run's own save at step N can land."""
    target, n = path.with_name(path.name + SET_ASIDE), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{SET_ASIDE}{n}")
    os.rename(path, target)
    return target
