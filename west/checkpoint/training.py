"""Crash-safe checkpoints: write into a temp dir, fsync, then one atomic rename.

Layout of ``DIR/checkpoints/step_00001234/``::

    model.safetensors     model state (rank 0; FSDP shards are gathered): by default without the
                          frozen base LLM, which meta.json refers to (west/checkpoint/model_state.py)
    adapter/              LoRA adapters in peft's format (adapter_config.json,
                          adapter_model.safetensors), with model.lora
    optimizer.pt          optimizer state, parameters named by FQN (rank 0; weights_only)
    scheduler.pt          LR scheduler counters (weights_only)
    rng_rank{R}.pt        torch/cuda/numpy/python RNG states of rank R (weights_only)
    data_rank{R}.json     rank R's data-pipeline state_dict (``.pt`` if not JSON-able)
    checksums.json        size and CRC-32 of every other file (west/checkpoint/checksums.py),
                          verified before a resume uses the dir
    meta.json             step, epoch, world size, loop state; written last; saved at a dev
                          evaluation it has "eval": {"cv_loss": ..., ...}, and "best" (the best
                          evaluation so far) whenever there was one; "model_state" (is the LLM
                          "included" or "referenced"), "base_llm" (path, sha256 of its files),
                          "lora" (r, alpha, target_modules)

Pruning keeps the newest ``keep_last`` and the ``keep_best`` lowest by a dev metric, read
from every checkpoint's meta.json (so kill -9 and resume cannot lose the ranking).

A directory named ``step_*`` exists only after every file in it was fsynced, so
a crash or a full disk during a save (whatever the writer raises: safetensors' own
``SafetensorError`` too) leaves the previous checkpoint as the latest one. No checkpoint is
written while the model or optimizer state holds NaN/inf, or while meta's ``guard`` counts
non-finite steps in a row: a bad state never takes the place of the last good one in
``keep_last``. Every file gets the same permission mode (0666 less the umask). Should a ``step_*`` dir still hold a truncated or unreadable file (a
filesystem that lost writes, a copy cut short), ``latest_usable`` reports it and takes
the newest whole one (west.checkpoint.integrity). The output dir must be visible to all
ranks (shared filesystem). Nothing here unpickles: safetensors, JSON and
``weights_only=True`` only.
"""
from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from west.checkpoint import checksums, files, model_state
from west.checkpoint.base_llm import BaseLLM
from west.checkpoint.integrity import PREFIX, check_checkpoint, read_checked_meta
from west.ranks import all_ranks, all_reduce_max, barrier, get_rank, get_world_size

TMP_PREFIX = ".tmp_"
TRASH_PREFIX = ".trash_"


class CheckpointError(RuntimeError):
    """A save failed (previous checkpoint intact) or a checkpoint cannot be loaded."""


class DiskFullError(CheckpointError):
    """A save ran out of space (on some rank); the previous checkpoint is intact."""


class NotFiniteError(CheckpointError):
    """A save refused: the state holds NaN/inf or the last steps were non-finite (previous one kept)."""


_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: Optional[BaseException]) -> bool:
    """ENOSPC / EDQUOT, as an OSError or inside another writer's error (safetensors raises
    ``SafetensorError("... I/O error: No space left on device (os error 28)")``)."""
    if isinstance(error, OSError):
        return error.errno in _FULL
    match = re.search(r"os error (\d+)", str(error))
    return bool(match) and int(match.group(1)) in _FULL


def _failure(error: Optional[BaseException]) -> int:
    """0 no error, 1 an error, 2 the disk is full (ENOSPC, EDQUOT): ranks agree on the max."""
    if error is None:
        return 0
    return 2 if is_disk_full(error) else 1


def _agree(error: Optional[BaseException]) -> int:
    """The worst outcome over all ranks (one small all-reduce; saves are rare)."""
    return int(all_reduce_max([_failure(error)])[0])


# ----------------------------------------------------------------------------- RNG

def rng_state() -> dict:
    """torch, CUDA, numpy and python RNG states as weights_only-loadable objects."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


# ----------------------------------------------------------------------------- listing

def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit() \
                and (p / "meta.json").is_file():
            found.append((int(p.name[len(PREFIX):]), p))
    return [p for _, p in sorted(found)]


def _remove(path: Path) -> None:
    """Rename first so a half-deleted dir never looks like a checkpoint."""
    if not path.exists():
        return
    trash = path.with_name(TRASH_PREFIX + path.name.lstrip("."))
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def eval_metric(meta: dict, metric: str) -> Optional[float]:
    """``meta["eval"][metric]`` when the checkpoint was saved at a dev evaluation and it is finite."""
    value = (meta.get("eval") or {}).get(metric)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def best_checkpoints(root: str | os.PathLike, n: int, metric: str = "cv_loss") -> list[Path]:
    """The ``n`` checkpoints with the lowest ``metric`` in their meta.json (ties: the older), best
    first. Read from disk, so the ranking survives kill -9 and resume."""
    scored = []
    for p in list_checkpoints(root):
        try:
            value = eval_metric(read_meta(p), metric)
        except (OSError, ValueError):
            continue
        if value is not None:
            scored.append((value, p))
    return [p for _, p in sorted(scored, key=lambda vp: vp[0])[:n]]


def better_eval(best: Optional[dict], figures: dict, step: int, metric: str) -> Optional[dict]:
    """The better of the best evaluation so far and this one (``{"step": S, **figures}``); lower wins."""
    value = eval_metric({"eval": figures}, metric)
    old = eval_metric({"eval": best}, metric) if best else None
    if value is None or (old is not None and old <= value):
        return best
    return {"step": step, **figures}


def prune(root: str | os.PathLike, keep_last: int, keep_best: int = 0, metric: str = "cv_loss") -> None:
    """Keep the newest ``keep_last`` checkpoints and the ``keep_best`` best by ``metric``; drop
    leftovers of interrupted saves."""
    root = Path(root)
    for p in root.iterdir():
        if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)
    keep = set(best_checkpoints(root, keep_best, metric)) if keep_best > 0 else set()
    for p in list_checkpoints(root)[:-keep_last]:
        if p not in keep:
            _remove(p)


# ----------------------------------------------------------------------------- save / load

def _first_nonfinite(state: Any, where: str) -> Optional[str]:
    """The name of the first floating tensor in a (nested) state dict holding NaN/inf, or None."""
    if isinstance(state, torch.Tensor):
        bad = state.is_floating_point() and state.numel() and not bool(torch.isfinite(state).all())
        return where if bad else None
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    for k, v in items:
        found = _first_nonfinite(v, f"{where}.{k}" if where else str(k))
        if found:
            return found
    return None


def refuse_reason(meta: dict, model_sd: dict, optim_sd: dict) -> Optional[str]:
    """Why this state must not become a checkpoint (it could prune the last good one), or None:
    non-finite steps in a row (meta's ``guard``), or NaN/inf in a model or optimizer tensor."""
    in_row = int((meta.get("guard") or {}).get("in_row", 0))
    if in_row:
        return f"the last {in_row} step(s) were non-finite (NaN/inf; train.max_bad_steps)"
    bad = _first_nonfinite(model_sd, "") or _first_nonfinite(optim_sd, "optimizer")
    return f"{bad} holds NaN/inf" if bad else None


def save_checkpoint(root: str | os.PathLike, step: int, *, model: nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: Any, data_state: Any,
                    meta: Optional[dict] = None, keep_last: int = 3, keep_best: int = 0,
                    best_metric: str = "cv_loss", base: Optional[BaseLLM] = None) -> Path:
    """Collective: every rank calls it. Returns the new checkpoint dir or raises
    CheckpointError after removing the partial one (older checkpoints untouched).

    With ``base`` the frozen parameters under ``base.prefix`` are neither gathered nor
    written; meta.json refers to ``base.path`` and the fingerprint of its files instead."""
    root = Path(root)
    rank, world = get_rank(), get_world_size()
    final, tmp = step_dir(root, step), root / f"{TMP_PREFIX}{PREFIX}{step:08d}"
    error: Optional[BaseException] = None
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
    except OSError as e:
        error = e
    outcome = _agree(error)
    if outcome:
        raise (DiskFullError if outcome == 2 else CheckpointError)(
            f"cannot create {tmp}{' (disk full)' if outcome == 2 else ''}: {error or 'on rank 0'}") from error

    # Full (unsharded, CPU) states on rank 0, empty elsewhere; collective under FSDP.
    from torch.distributed.checkpoint.state_dict import (  # heavy
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if base is not None:
        model_sd = model_state.gather_lean_state(model, model_state.frozen_names(model, base.prefix))
    else:
        model_sd = get_model_state_dict(model, options=full)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=full)
    why = refuse_reason(meta or {}, model_sd, optim_sd) if rank == 0 else None
    if _agree(NotFiniteError(why) if why else None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        previous = list_checkpoints(root)
        kept = f"previous checkpoint {previous[-1]} kept" if previous else "no earlier checkpoint"
        raise NotFiniteError(f"no checkpoint at step {step}: {why or 'refused on rank 0'}; {kept}")
    meta = {**(meta or {}), "model_state": {"llm": "included" if base is None else "referenced"}}
    try:
        if rank == 0:
            if base is not None:
                meta["base_llm"] = base.reference()  # hashed once per process (rank 0 only)
            settings = model_state.lora_settings(model)
            if settings:
                meta["lora"] = settings
            model_sd, adapter = model_state.split_adapter(model, model_sd)
            files.save_tensors(model_sd, tmp / "model.safetensors")
            if adapter is not None:
                for f in model_state.write_adapter(adapter, tmp / model_state.ADAPTER_DIR):
                    files.fsync_path(f)
                files.fsync_path(tmp / model_state.ADAPTER_DIR)
            files.save_torch(optim_sd, tmp / "optimizer.pt")
            files.save_torch(scheduler.state_dict(), tmp / "scheduler.pt")
        files.save_torch(rng_state(), tmp / f"rng_rank{rank}.pt")
        try:
            payload = json.dumps(data_state).encode("utf-8")
            files.write_bytes(tmp / f"data_rank{rank}.json", payload)
        except TypeError:
            files.save_torch(data_state, tmp / f"data_rank{rank}.pt")
    except Exception as e:  # noqa: BLE001 - any writer's failure (SafetensorError is no OSError)
        error = e
    del model_sd, optim_sd
    outcome = _agree(error)
    if not outcome and rank == 0:
        try:
            files.save_json({"step": step, "world_size": world, **meta}, tmp / "meta.json")
            files.same_mode(tmp)  # peft's adapter files too
            checksums.record(tmp)
            files.fsync_path(tmp)
            if final.exists():  # same step saved again (e.g. epoch end == save_every)
                _remove(final)
            os.rename(tmp, final)
            files.fsync_path(root)
        except Exception as e:  # noqa: BLE001
            error = e
    outcome = max(outcome, _agree(error))
    if outcome:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        previous = list_checkpoints(root)
        kept = f"previous checkpoint {previous[-1]} kept" if previous else "no earlier checkpoint"
        if outcome == 2:
            raise DiskFullError(f"checkpoint at step {step} failed (disk full): {error or 'on another rank'}; "
                                f"{kept}: free space, then run the same command to resume") from error
        raise CheckpointError(f"checkpoint at step {step} failed: {error or 'on another rank'}; {kept}") from error
    if rank == 0:
        prune(root, keep_last, keep_best, best_metric)
    barrier()
    return final


def read_meta(path: str | os.PathLike) -> dict:
    with open(Path(path) / "meta.json", encoding="utf-8") as f:
        return json.load(f)


def load_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, restore_rng: bool = True, base: Optional[BaseLLM] = None) -> dict:
    """Collective: restore model/optimizer/scheduler (+ this rank's RNG) from ``path``.

    Returns meta.json plus ``data_state`` (this rank's data-pipeline state). Resuming
    with another world size is refused: each rank's data position would be wrong. A
    checkpoint that refers to a base LLM needs ``base`` (this run's, already loaded in
    ``model``) with the same fingerprint; LoRA settings must match (west/checkpoint/model_state.py).
    """
    path = Path(path)
    rank, world = get_rank(), get_world_size()
    problem, meta = read_checked_meta(path)
    if not problem and meta["world_size"] != world:
        raise CheckpointError(f"{path} was saved by {meta['world_size']} ranks, this run has {world}: "
                              "the data position of each rank cannot be mapped; resume with the same "
                              "world size or start a new output_dir")
    problem = problem or check_checkpoint(path)
    if problem:
        raise CheckpointError(f"{path}: not a complete checkpoint ({problem})")
    from torch.distributed.checkpoint.state_dict import (  # heavy
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    distributed = world > 1
    # A lean checkpoint leaves the frozen base out: those entries keep the weights just loaded
    # from the (verified) base path; every other entry was checked to be present.
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed,
                            strict=not meta.get("base_llm"))
    model_sd, optim_sd, error = {}, {}, None
    if rank == 0 or not distributed:  # rank 0 reads and checks, then broadcasts
        try:
            model_sd = model_state.load_model_weights(path, meta, model, base)
            optim_sd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        except (model_state.LeanError, OSError) as e:
            error = e
    if not all_ranks(error is None):
        raise CheckpointError(str(error) if error else f"{path}: refused on rank 0 (see its log)") from error
    set_model_state_dict(model, model_sd, options=opts)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)
    del model_sd, optim_sd
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    if restore_rng:
        set_rng_state(torch.load(path / f"rng_rank{rank}.pt", weights_only=True))
    data_json, data_pt = path / f"data_rank{rank}.json", path / f"data_rank{rank}.pt"
    if data_json.is_file():
        meta["data_state"] = json.loads(data_json.read_text(encoding="utf-8"))
    elif data_pt.is_file():
        meta["data_state"] = torch.load(data_pt, weights_only=True)
    else:
        raise CheckpointError(f"{path}: no data state for rank {rank}")
    return meta
