#!/usr/bin/env python3
"""A randomly initialised released speech LLM's directory (config, weights, processor, tokenizer with
the audio tokens, chat template) written by save_pretrained, at its published shape or a tiny one, to
try a model.type or to time it and measure its memory where no download is possible.

    python tools/make_random_released.py qwen2_audio exp/qwen2_audio_7b --shape release --device cuda
    python tools/make_random_released.py qwen3_asr exp/qwen3_asr_tiny
    west-train --config recipes/aishell/conf/qwen3_asr_lora.yaml --model.path exp/qwen3_asr_tiny ...

The published shapes: Qwen2-Audio-7B, Qwen3-ASR-1.7B, Qwen2.5-Omni-7B's thinker (its vision tower a toy
one: west never reads it). The tokenizer is always a small one; the vocabulary rows are as released.
"""
from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

# model.type: (module, writer, the shape name the writer gives the release, keyword arguments as released)
WRITERS = {
    "qwen2_audio": ("west.models.random_qwen2_audio", "write_random_qwen2_audio", "7b", {}),
    "qwen3_asr": ("west.models.random_qwen3_asr", "write_random_qwen3_asr", "1.7b", {"n_window_infer": 800}),
    "qwen2_5_omni": ("west.models.random_qwen2_5_omni", "write_random_qwen2_5_omni", "7b", {"n_window": 100}),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("type", choices=sorted(WRITERS), help="the model.type it is read with")
    p.add_argument("out", help="directory to write")
    p.add_argument("--shape", default="tiny", choices=["tiny", "release"])
    p.add_argument("--device", default="cpu", help="where to draw the weights (cuda: much faster)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args(argv)
    import torch

    module, writer, release, as_released = WRITERS[a.type]
    write = getattr(importlib.import_module(module), writer)
    t0 = time.perf_counter()
    kwargs = dict(as_released, shape=release) if a.shape == "release" else dict(as_released)
    write(a.out, device=a.device, dtype=getattr(torch, a.dtype), **kwargs)
    n = sum(f.stat().st_size for f in Path(a.out).glob("*.safetensors"))
    print(f"make_random_released: {a.type} ({a.shape}) with random {a.dtype} weights in {a.out}: "
          f"{n / 2**30:.1f} GiB of weights, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
