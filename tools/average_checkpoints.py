#!/usr/bin/env python3
"""Average the weights of a run's checkpoints into a model dir west-decode reads (WeNet's average_model).

    python tools/average_checkpoints.py exp/tiny_cpu exp/tiny_cpu/avg_3 --num 3 --mode best --metric cv_cer
    west-decode --checkpoint exp/tiny_cpu/avg_3 --data data/test/data.list --result ...

--mode best takes the N checkpoints with the lowest dev metric in their meta.json
(``"eval"``, written by west-train with --cv_data), --mode last the newest N. Floating
tensors are averaged in float64 and cast back to their dtype; integer and bool tensors
(buffers such as step counters) are taken from the newest chosen checkpoint; a lean checkpoint's
frozen base LLM is read from model.llm.path (its fingerprint checked) and its LoRA adapters are
averaged like any weight. OUT_DIR gets a save_speech_llm directory (LLM included) with
the tokenizer, the run's config.yaml (west-decode builds prompts from its data section) and
averaged.json naming the steps and their figures.
Exit status 2 on a run dir without usable checkpoints.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
import yaml
from tqdm import tqdm

from west.checkpoint.base_llm import BaseLLM, LeanError, check_base
from west.checkpoint.files import load_tensors
from west.checkpoint.model_state import check_keys, check_lora, read_model_state
from west.checkpoint.pretrained import save_speech_llm
from west.checkpoint.restore import build_from_run
from west.checkpoint.training import best_checkpoints, eval_metric, list_checkpoints, read_meta

METRICS = ("cv_loss", "cv_cer", "cv_wer")


class AverageError(Exception):
    """A run dir this tool cannot average (message for the user; exit status 2)."""


def select_checkpoints(run_dir: Path, num: int, mode: str, metric: str) -> tuple[list[tuple[Path, dict]], str]:
    """(the chosen (checkpoint dir, meta) pairs, best first for --mode best, oldest first for
    --mode last; a note when fewer than ``num`` could be chosen, else "").

    --mode best ranks as west-train's keep_best does (lower is better, ties: the older), so
    with --num <= train.keep_best the chosen checkpoints are the ones it kept for that."""
    root = run_dir / "checkpoints"
    ckpts = list_checkpoints(root)
    if not ckpts:
        raise AverageError(f"no checkpoints in {root} (is {run_dir} a west-train run dir?)")
    if mode == "last":
        chosen = ckpts[-num:]
        pool = f"{len(ckpts)} checkpoint(s)"
    else:
        scored = best_checkpoints(root, len(ckpts), metric)
        if not scored:
            raise AverageError(
                f"--mode best --metric {metric}: none of the {len(ckpts)} checkpoint(s) in {root} has a "
                f"dev {metric} in its meta.json (west-train records it with --cv_data and train.keep_best > 0"
                + (" and train.eval_decode_utts > 0" if metric != "cv_loss" else "")
                + "); use another --metric, or --mode last")
        chosen = scored[:num]
        pool = f"{len(scored)} checkpoint(s) with a dev {metric}"
    note = f"asked for {num}, the run has only {pool}: averaging {len(chosen)}" if len(chosen) < num else ""
    return [(p, read_meta(p)) for p in chosen], note


def average_state_dicts(paths: list[Path], read: Optional[Callable[[Path], dict]] = None
                        ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(mean of the floating tensors, accumulated in float64 and cast back; every other tensor
    from the LAST path), names of the tensors that were not averaged. ``read`` gives one
    checkpoint's tensors (default: its model.safetensors)."""
    read = read or (lambda p: load_tensors(p / "model.safetensors"))
    acc: dict[str, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}
    first: dict[str, tuple[tuple, torch.dtype]] = {}
    bar = tqdm(paths, desc="average", unit="ckpt", disable=True if len(paths) < 3 else None)
    for i, path in enumerate(bar):
        state = read(path)
        if i == 0:
            first = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
        elif set(state) != set(first):
            diff = sorted(set(state) ^ set(first))
            raise AverageError(f"{path}: not the same model as {paths[0]} (tensors differ: {diff[:5]})")
        for name, t in state.items():
            if (tuple(t.shape), t.dtype) != first[name]:
                raise AverageError(f"{path}: {name} is {tuple(t.shape)} {t.dtype}, in {paths[0]} "
                                   f"{first[name][0]} {first[name][1]}")
            if not t.is_floating_point():
                kept[name] = t
            elif i == 0:  # a copy: tied names share one tensor, each needs its own sum
                acc[name] = t.to(torch.float64, copy=True)
            else:
                acc[name] += t.to(torch.float64)
        del state
    avg = {name: (s / len(paths)).to(first[name][1]) for name, s in acc.items()}
    return {**avg, **kept}, sorted(kept)


def format_figures(meta: dict) -> str:
    """'cv_loss 1.234, cv_cer 5.67%' for a checkpoint's dev figures ('' without an evaluation)."""
    parts = []
    for m in METRICS:
        v = eval_metric(meta, m)
        if v is not None:
            parts.append(f"{m} {v:.4f}" if m == "cv_loss" else f"{m} {100 * v:.2f}%")
    return ", ".join(parts)


def average_checkpoints(run_dir: Path, out_dir: Path, num: int, mode: str = "best",
                        metric: str = "cv_loss") -> dict:
    """Average, export to ``out_dir`` and return what averaged.json records."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if num < 1:
        raise AverageError(f"--num must be at least 1 (got {num})")
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise AverageError(f"{config} is missing: not a west-train run dir")
    chosen, note = select_checkpoints(run_dir, num, mode, metric)
    if note:
        print(f"note: {note}", file=sys.stderr)
    by_step = sorted(chosen, key=lambda pm: int(pm[1]["step"]))   # the newest last
    raw = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    section = by_step[-1][1].get("model") or (raw.get("model") if isinstance(raw, dict) else None)
    if not section:   # the newest checkpoint's own model section first (config.yaml may be newer)
        raise AverageError(f"{config}: no model section")
    # Lean checkpoints leave the frozen base LLM out: build on its weights (fingerprint checked).
    referenced = any(m.get("base_llm") for _, m in by_step)
    model, tokenizer = build_from_run(section, weights=referenced)
    base = BaseLLM(model.cfg.llm.path) if referenced else None
    try:
        for p, m in by_step:
            check_lora(p, m, model)
            check_base(p, m, base)
        state, kept = average_state_dicts([p for p, _ in by_step], read=lambda p: read_model_state(p, model))
        check_keys(by_step[-1][0], by_step[-1][1], model, state)
    except LeanError as e:
        raise AverageError(str(e)) from None
    if kept:
        print(f"note: {len(kept)} non-floating tensor(s) not averaged, taken from the newest chosen "
              f"checkpoint (step {by_step[-1][1]['step']}): {', '.join(kept[:5])}"
              + (" ..." if len(kept) > 5 else ""), file=sys.stderr)
    model.load_state_dict(state, strict=not referenced)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_speech_llm(model, out_dir, tokenizer=tokenizer)
    shutil.copy(config, out_dir / "config.yaml")
    record = {"run_dir": str(run_dir.resolve()), "mode": mode, "metric": metric, "num": num,
              "steps": [int(m["step"]) for _, m in chosen],
              "checkpoints": [{"step": int(m["step"]), "path": str(p.resolve()), "eval": m.get("eval") or {}}
                              for p, m in chosen],
              "not_averaged": kept}
    (out_dir / "averaged.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return record


def summary_line(record: dict, out_dir: Path) -> str:
    """One readable line: which steps, their dev figures, where the model went."""
    how = f"{record['mode']} by {record['metric']}" if record["mode"] == "best" else "last"
    items = []
    for c in record["checkpoints"]:
        fig = format_figures(c)
        items.append(f"step {c['step']}" + (f" ({fig})" if fig else ""))
    return f"averaged {len(items)} checkpoint(s) ({how}): {'; '.join(items)} -> {out_dir}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="west-train output dir (config.yaml, checkpoints/)")
    p.add_argument("out_dir", type=Path, help="model dir to write (west-decode --checkpoint OUT_DIR)")
    p.add_argument("--num", type=int, default=3, help="checkpoints to average [3]")
    p.add_argument("--mode", choices=["best", "last"], default="best",
                   help="best: lowest dev --metric; last: the newest [best]")
    p.add_argument("--metric", choices=METRICS, default="cv_loss", help="ranking of --mode best [cv_loss]")
    a = p.parse_args(argv)
    try:
        record = average_checkpoints(a.run_dir, a.out_dir, a.num, a.mode, a.metric)
    except AverageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary_line(record, a.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
