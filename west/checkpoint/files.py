"""The bytes of every checkpoint format: fsynced small files and one safetensors rule.

One tied-weight rule for all of west's weight files (training checkpoints, ``save_speech_llm``,
exports): safetensors refuses tensors that share storage, so each tensor is stored once and the
other names that view it are recorded as aliases in the file's metadata (``west_aliases``);
:func:`load_tensors` puts the aliases back. Files written before the rule was shared (tied
tensors simply left out) still load; their missing names are the model's own tied ones.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

ALIASES_KEY = "west_aliases"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_mode() -> int:
    """The mode ``open()`` gives a new file (0666 less the umask). safetensors creates its files
    0600: every file west writes gets this one mode instead."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: read the umask by setting it (and put it back)
    os.umask(mask)
    return 0o666 & ~mask


def same_mode(root: Path) -> None:
    """Give every file under ``root`` the mode :func:`file_mode` (one mode for a whole checkpoint)."""
    mode = file_mode()
    for p in root.rglob("*"):
        if p.is_file() and (p.stat().st_mode & 0o777) != mode:
            os.chmod(p, mode)


def write_bytes(path: Path, data: bytes) -> None:
    """Every small file of a checkpoint goes through here (tests inject ENOSPC)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_torch(obj: Any, path: Path) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    write_bytes(path, buf.getvalue())


def save_json(obj: Any, path: Path) -> None:
    write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode("utf-8"))


def save_tensors(state: dict[str, torch.Tensor], path: Path, metadata: Optional[dict[str, str]] = None) -> None:
    """Write ``state`` (CPU or not) to ``path``, tied tensors once with their aliases, then fsync."""
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    tensors, aliases = {}, {}
    for name, t in state.items():
        t = t.detach()
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        # A partial overlap with a kept tensor cannot be aliased: store a copy.
        t = t.clone() if (t.numel() and ptr in storages) else t.contiguous()
        tensors[name] = t.cpu()
        storages.add(ptr)
    save_file(tensors, str(path), metadata={**(metadata or {}), ALIASES_KEY: json.dumps(aliases)})
    os.chmod(path, file_mode())
    fsync_path(path)


def tensors_metadata(path: Path) -> dict[str, str]:
    """The string metadata of a safetensors file (header only)."""
    from safetensors import safe_open  # heavy

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A state dict written by :func:`save_tensors`, its tied tensors re-aliased."""
    aliases = json.loads(tensors_metadata(path).get(ALIASES_KEY, "{}"))
    state = load_file(str(path))
    for name, target in aliases.items():
        state[name] = state[target]
    return state
