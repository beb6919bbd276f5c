#!/usr/bin/env python3
"""How much of the computed work is real data, per batch mode (from lengths only).

For a list with lengths (``duration`` or ``num_frames``; see
tools/compute_lengths.py) it plans one epoch per batch mode exactly as the
loader does and prints, per mode: batches, LLM real/computed tokens (padding
and pack tails are waste) and encoder real/computed frames (padding is waste;
a packed encoder computes no padding). Nothing is decoded.

    python tools/data_stats.py data/train/data.list --tokenizer exp/tiny_llm \
        --batch_type static dynamic pack --batch_size 32 --max_tokens_in_batch 4096 --pack_tokens 8192
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from west.data.config import add_data_args, config_from_args  # noqa: E402
from west.data.dataset import SpeechDataset  # noqa: E402
from west.data.features import estimate_frames  # noqa: E402
from west.data.plan import plan_epoch  # noqa: E402


def mode_stats(data_list: str, tokenizer, conf, world_size: int = 1, seed: int = 0) -> dict:
    """Totals over one planned epoch (all ranks) for ``conf.batch_type``."""
    ds = SpeechDataset(data_list, tokenizer, conf.replace(plan="always"), 0, world_size, seed)
    frames = [[estimate_frames(a, conf) for a in ds.source.record(i)["audio"]] for i in range(len(ds.source))]
    rng = np.random.default_rng([seed, 0]) if conf.shuffle else None
    steps = plan_epoch(ds.eligible, ds.lengths, conf, world_size, rng)
    t = dict(batches=0, utterances=0, real_llm=0, computed_llm=0, real_enc=0, computed_enc=0,
             computed_enc_padded=0)
    for step in steps:
        for idx in step:
            t["batches"] += 1
            if not idx:
                continue
            lens = ds.lengths[idx]
            seg = [f for i in idx for f in frames[i]]
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
    t["steps"] = len(steps)
    t["skipped"] = ds.list_skips.skipped
    t["llm_ratio"] = t["real_llm"] / max(1, t["computed_llm"])
    t["enc_ratio"] = t["real_enc"] / max(1, t["computed_enc"])
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_list")
    p.add_argument("--tokenizer", required=True, help="directory loadable with AutoTokenizer.from_pretrained")
    p.add_argument("--world_size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the numbers here")
    p.add_argument("--batch_type", nargs="+", default=["static", "dynamic", "pack"])
    add_data_args(p, exclude=("batch_type",))
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    modes = a.batch_type
    base = config_from_args(a, exclude=("batch_type",))
    rows = {}
    for mode in modes:
        conf = base.replace(batch_type=mode)
        rows[mode] = mode_stats(a.data_list, tok, conf, a.world_size, a.seed)
        if mode == "pack":
            other = "padded" if conf.encoder_layout == "packed" else "packed"
            rows[f"pack (encoder {other})"] = mode_stats(a.data_list, tok, conf.replace(encoder_layout=other),
                                                         a.world_size, a.seed)
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
