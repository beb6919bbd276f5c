#!/usr/bin/env python3
"""Loader throughput: utterances/s (wall, and per core of CPU time) per batch mode,
feature type (Kaldi fbank, Whisper log-mel) and worker count, plus where the CPU goes.

Without --list it synthesizes a corpus (noise wavs with AIShell-like durations,
1.5-9 s, mean ~4.5 s) and a tiny tokenizer in a temp dir. Each cell is one full
epoch of the real loader (decode, features, tokenize, batch, collate), worker
start-up included. "utts/s per core" = utterances / CPU seconds of the process and
its workers: what one core sustains, whatever else the machine runs. The stage table
runs the pipeline's stages (west.data.processors.stages) on growing prefixes
(load; load + features; ...), so each row is the CPU a stage adds per utterance.
Prints markdown tables and writes JSON. Not a test.

    python tools/bench_loader.py --num_utts 400 --json exp/bench_loader.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import soundfile as sf

from west.data.config import DataConfig
from west.data.dataset import build_dataloader
from west.data.processors import DecodeContext, stages
from west.data.stats import DataStats
from west.models.config import SpeechLLMConfig
from west.models.whisper_encoder import WHISPER_STAGES
from west.shapes import SpeechShape

# The geometry each feature type's encoder gives the data side (whisper: its 30 s window, 80 bins).
SHAPES = {"fbank": SpeechLLMConfig().speech_shape(),
          "whisper": SpeechShape(encoder_type="whisper", max_frames=3000, num_mel_bins=80,
                                 frame_stages=WHISPER_STAGES, features="whisper")}

WORDS = "the of speech model data pack batch token audio train hello world today weather".split()


def synth_corpus(out_dir: str, n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        secs = float(np.clip(rng.normal(4.5, 1.5), 1.5, 9.0))
        path = os.path.join(out_dir, f"b{i:05d}.wav")
        sf.write(path, (0.1 * rng.standard_normal(int(secs * 16000))).astype(np.float32), 16000, subtype="PCM_16")
        txt = " ".join(rng.choice(WORDS, int(rng.integers(8, 20))))
        rows.append({"key": f"b{i:05d}", "wav": path, "txt": txt, "duration": round(secs, 3)})
    list_path = os.path.join(out_dir, "data.list")
    with open(list_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return list_path


def _cpu_seconds() -> float:
    """CPU time of this process and its (finished) children: workers included."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run(list_path: str, tokenizer, conf: DataConfig, shape: SpeechShape) -> dict:
    t0 = time.perf_counter()
    loader, ds = build_dataloader(list_path, tokenizer, conf, shape, seed=0, epoch=0)
    t1, c1 = time.perf_counter(), _cpu_seconds()
    utts = batches = 0
    for b in loader:
        utts += b.counters["utterances"]
        batches += 1
    t2, c2 = time.perf_counter(), _cpu_seconds()
    cpu = max(c2 - c1, 1e-9)
    return {"utterances": utts, "batches": batches, "setup_s": round(t1 - t0, 3), "epoch_s": round(t2 - t1, 3),
            "utts_per_s": round(utts / (t2 - t1), 1), "cpu_ms_per_utt": round(1000 * cpu / max(1, utts), 1),
            "utts_per_core_s": round(utts / cpu, 1),
            "load_avg_1min": round(os.getloadavg()[0], 2), "steps_planned": len(ds)}


def stage_costs(list_path: str, tokenizer, conf: DataConfig, shape: SpeechShape) -> list[dict]:
    """CPU ms per utterance each stage adds, measured on growing prefixes of the stage chain
    (one whole untimed pass first, so caches and lazy imports are warm)."""
    _, ds = build_dataloader(list_path, tokenizer, conf, shape, seed=0, epoch=0)
    ids = [int(i) for batch in ds.rank_batches() for i in batch]
    chain = stages(conf)

    def cpu_ms_per_utt(k: int) -> float:
        ctx = DecodeContext(conf, ds.encoder, DataStats(), ds.cmvn, True, 0, 0, budget=ds.policy.sample_budget())
        stream = (ds.record(i) for i in ids)
        for stage in chain[:k]:
            stream = stage(stream, ctx)
        c0 = time.process_time()
        n = sum(1 for _ in stream)
        return 1000 * (time.process_time() - c0) / max(1, n)

    cpu_ms_per_utt(len(chain))
    rows, before = [], 0.0
    for k in range(1, len(chain) + 1):
        total = cpu_ms_per_utt(k)
        rows.append({"stage": chain[k - 1].__name__, "cpu_ms_per_utt": round(total - before, 2)})
        before = total
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", help="jsonl list (default: synthesize one)")
    p.add_argument("--tokenizer", help="tokenizer dir (default: build a tiny one)")
    p.add_argument("--num_utts", type=int, default=400)
    p.add_argument("--batch_type", nargs="+", default=["static", "dynamic", "pack"])
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--features", nargs="+", default=["fbank", "whisper"], choices=sorted(SHAPES))
    p.add_argument("--json", default="bench_loader.json")
    a = p.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)   # as in a loader worker: per-core figures
    tmp = tempfile.TemporaryDirectory()
    list_path = a.list or synth_corpus(tmp.name, a.num_utts)
    if a.tokenizer:
        tok = AutoTokenizer.from_pretrained(a.tokenizer)
    else:
        from west.models.tiny_llm import build_tokenizer

        tok = build_tokenizer([" ".join(WORDS)] * 20 + ["Transcribe the speech."], os.path.join(tmp.name, "tok"), 300)
    sizes = {"static": {"batch_size": 32}, "dynamic": {"max_tokens_in_batch": 4096}, "pack": {"pack_tokens": 8192}}
    results, breakdown = [], {}
    for feats in a.features:
        for bt in a.batch_type:
            for w in a.workers:
                conf = DataConfig(batch_type=bt, num_workers=w, features=feats, **sizes[bt])
                r = run(list_path, tok, conf, SHAPES[feats])
                r.update(features=feats, batch_type=bt, num_workers=w)
                results.append(r)
        breakdown[feats] = stage_costs(list_path, tok, DataConfig(features=feats), SHAPES[feats])
    print("| features | batch_type | workers | steps planned | batches | utterances | epoch s | utts/s | "
          "CPU ms/utt | utts/s per core | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['features']} | {r['batch_type']} | {r['num_workers']} | {r['steps_planned']} | {r['batches']} | "
              f"{r['utterances']} | {r['epoch_s']} | {r['utts_per_s']} | {r['cpu_ms_per_utt']} | "
              f"{r['utts_per_core_s']} | {r['load_avg_1min']} |")
    print("\n| features | stage | CPU ms per utterance |\n|---|---|---|")
    for feats, rows in breakdown.items():
        for row in rows:
            print(f"| {feats} | {row['stage']} | {row['cpu_ms_per_utt']} |")
    meta = {"cpu_count": os.cpu_count(), "python": platform.python_version(), "num_utts": a.num_utts,
            "list": a.list or "synthesized", "command": " ".join(sys.argv)}
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "results": results, "stages": breakdown}, f, indent=1)
    print(f"wrote {a.json}", file=sys.stderr)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
