#!/usr/bin/env python3
"""Loader throughput: utterances/s for each batch mode with 0 and 2 workers.

Without --list it synthesizes a corpus (noise wavs with AIShell-like durations,
1.5-9 s, mean ~4.5 s) and a tiny tokenizer in a temp dir. Each cell is one full
epoch of the real loader (decode, fbank, tokenize, batch, collate), worker
start-up included. Prints a markdown table and writes JSON. Not a test.

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
from west.models.config import SpeechLLMConfig
from west.shapes import SpeechShape

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
    return {"utterances": utts, "batches": batches, "setup_s": round(t1 - t0, 3), "epoch_s": round(t2 - t1, 3),
            "utts_per_s": round(utts / (t2 - t1), 1), "cpu_ms_per_utt": round(1000 * (c2 - c1) / max(1, utts), 1),
            "load_avg_1min": round(os.getloadavg()[0], 2), "steps_planned": len(ds)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", help="jsonl list (default: synthesize one)")
    p.add_argument("--tokenizer", help="tokenizer dir (default: build a tiny one)")
    p.add_argument("--num_utts", type=int, default=400)
    p.add_argument("--batch_type", nargs="+", default=["static", "dynamic", "pack"])
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--json", default="bench_loader.json")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    tmp = tempfile.TemporaryDirectory()
    list_path = a.list or synth_corpus(tmp.name, a.num_utts)
    if a.tokenizer:
        tok = AutoTokenizer.from_pretrained(a.tokenizer)
    else:
        from west.models.tiny_llm import build_tokenizer

        tok = build_tokenizer([" ".join(WORDS)] * 20 + ["Transcribe the speech."], os.path.join(tmp.name, "tok"), 300)
    sizes = {"static": {"batch_size": 32}, "dynamic": {"max_tokens_in_batch": 4096}, "pack": {"pack_tokens": 8192}}
    shape = SpeechLLMConfig().speech_shape()   # the default model's geometry sizes the prompts
    results = []
    for bt in a.batch_type:
        for w in a.workers:
            conf = DataConfig(batch_type=bt, num_workers=w, **sizes[bt])
            r = run(list_path, tok, conf, shape)
            r.update(batch_type=bt, num_workers=w)
            results.append(r)
    print("| batch_type | workers | steps planned | batches | utterances | epoch s | utts/s | CPU ms/utt | load avg |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['batch_type']} | {r['num_workers']} | {r['steps_planned']} | {r['batches']} | {r['utterances']} | "
              f"{r['epoch_s']} | {r['utts_per_s']} | {r['cpu_ms_per_utt']} | {r['load_avg_1min']} |")
    meta = {"cpu_count": os.cpu_count(), "python": platform.python_version(), "num_utts": a.num_utts,
            "list": a.list or "synthesized", "command": " ".join(sys.argv)}
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {a.json}", file=sys.stderr)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
