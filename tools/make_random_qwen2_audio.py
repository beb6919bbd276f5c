#!/usr/bin/env python3
"""A randomly initialised Qwen2-Audio directory (config, weights, processor, tokenizer with the audio
tokens) of the published 7B shape or a tiny one, for timing and memory where no download is possible.

    python tools/make_random_qwen2_audio.py exp/qwen2_audio_7b --shape 7b --device cuda
"""
from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write")
    p.add_argument("--shape", default="tiny", choices=["tiny", "7b"])
    p.add_argument("--device", default="cpu", help="where to draw the weights (cuda: much faster)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args(argv)
    import torch

    from west.models.random_qwen2_audio import write_random_qwen2_audio

    t0 = time.perf_counter()
    write_random_qwen2_audio(a.out, shape=a.shape, device=a.device, dtype=getattr(torch, a.dtype))
    print(f"make_random_qwen2_audio: {a.shape} Qwen2-Audio with random {a.dtype} weights in {a.out} "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
