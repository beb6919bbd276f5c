#!/usr/bin/env python3
"""How much of the computed work is real data, per batch mode (from lengths only).

For a list with lengths (``duration`` or ``num_frames``; see
tools/compute_lengths.py), of any kind west reads (jsonl, tar shards, Kaldi, Lhotse
cuts or Shar, a Hugging Face dataset), it plans one epoch per batch mode exactly as the
loader does and prints, per mode: batches, LLM real/computed tokens (padding
and pack tails are waste) and encoder real/computed frames (padding is waste;
a packed encoder computes no padding). Nothing is decoded.

    python tools/data_stats.py data/train/data.list --tokenizer exp/tiny_llm \
        --batch_type static dynamic pack --batch_size 32 --max_tokens_in_batch 4096 --pack_tokens 8192

Data and model options come from ``--config`` (a training YAML: its ``data`` and
``model`` sections) and ``--data.key VALUE`` / ``--model.key VALUE`` overrides, as
in west-train (e.g. ``--data.pack_algorithm ffd --model.projector.stride 3``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence

from west.config import Config, ConfigError, merge, split_overrides
from west.data.config import DataConfig
from west.data.dataset import SpeechDataset
from west.data.features import estimate_frames
from west.data.lists import open_list
from west.data.stats import DataStats
from west.shapes import SpeechShape

SIZE_FLAGS = ("batch_size", "max_tokens_in_batch", "pack_tokens")


def part_frames(data_lists: str | Sequence[str], conf: DataConfig) -> list[list[int]]:
    """Feature frames of every audio part of every record (numbered as the dataset numbers them),
    from the lists' metadata: no audio is read, whatever the list kind (a dataset's rows included)."""
    paths = [p for p in data_lists.split(",") if p] if isinstance(data_lists, str) else list(data_lists)
    frames: list[list[int]] = []
    for path in paths:
        open_list(path, DataStats(0), conf.data_type,
                  lambda rec: frames.append([estimate_frames(a, conf) or 0 for a in rec.audio]), conf)
    return frames


def mode_stats(data_lists: str | Sequence[str], tokenizer, conf: DataConfig, shape: SpeechShape,
               world_size: int = 1, seed: int = 0) -> dict:
    """Totals over one planned epoch (all ranks) for ``conf.batch_type``."""
    ds = SpeechDataset(data_lists, tokenizer, conf, shape, 0, world_size, seed)
    frames = part_frames(data_lists, conf)
    plan = ds.plan()
    t = dict(batches=0, utterances=0, real_llm=0, computed_llm=0, real_enc=0, computed_enc=0,
             computed_enc_padded=0)
    for b in range(plan.n_steps * world_size):
        idx = plan.batch(b)
        t["batches"] += 1
        if not len(idx):
            continue
        lens = ds.lengths[idx]
        seg = [f for i in idx for f in frames[int(i)]]
        t["utterances"] += len(idx)
        t["real_llm"] += int(lens.sum())
        t["real_enc"] += sum(seg)
        padded_enc = len(seg) * max(seg, default=0)
        if conf.batch_type == "pack":
            t["computed_llm"] += conf.pack_tokens
            t["computed_enc"] += sum(seg) if conf.encoder_layout == "packed" else padded_enc
        else:
            t["computed_llm"] += len(idx) * int(lens.max())
            t["computed_enc"] += padded_enc
        t["computed_enc_padded"] += padded_enc
    t["steps"] = plan.n_steps
    t["skipped"] = sum(stats.skipped for _, stats in ds.list_skips)
    t["llm_ratio"] = t["real_llm"] / max(1, t["computed_llm"])
    t["enc_ratio"] = t["real_enc"] / max(1, t["computed_enc"])
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_list", help="data list(s), comma-separated for several (weights: --data.weights)")
    p.add_argument("--tokenizer", required=True, help="directory loadable with AutoTokenizer.from_pretrained")
    p.add_argument("--config", help="training YAML whose data and model sections to use")
    p.add_argument("--world_size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the numbers here")
    p.add_argument("--batch_type", nargs="+", default=["static", "dynamic", "pack"])
    for key in SIZE_FLAGS:
        p.add_argument(f"--{key}", help=f"data.{key}")
    a, rest = p.parse_known_args(argv)
    try:
        flags = [(f"data.{k}", getattr(a, k)) for k in SIZE_FLAGS if getattr(a, k) is not None]
        cfg = Config.from_dict(merge(a.config, flags + split_overrides(rest)))  # typed, no paths checked
        base, shape = cfg.data, cfg.model.speech_shape()
        confs = {mode: dataclasses.replace(base, batch_type=mode) for mode in a.batch_type}
    except ConfigError as e:
        p.error(str(e))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    rows = {}
    for mode, conf in confs.items():
        rows[mode] = mode_stats(a.data_list, tok, conf, shape, a.world_size, a.seed)
        if mode == "pack":
            other = "padded" if conf.encoder_layout == "packed" else "packed"
            rows[f"pack (encoder {other})"] = mode_stats(a.data_list, tok, dataclasses.replace(conf, encoder_layout=other),
                                                         shape, a.world_size, a.seed)
    print("| mode | batches | steps | utts/batch | LLM real/computed | encoder real/computed | skipped |")
    print("|---|---|---|---|---|---|---|")
    for mode, t in rows.items():
        print(f"| {mode} | {t['batches']} | {t['steps']} | {t['utterances'] / max(1, t['batches']):.1f} | "
              f"{t['llm_ratio']:.1%} | {t['enc_ratio']:.1%} | {t['skipped']} |")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
