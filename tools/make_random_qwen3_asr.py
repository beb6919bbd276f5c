#!/usr/bin/env python3
"""A randomly initialised tiny Qwen3-ASR directory (config, weights, processor, tokenizer with the audio
tokens, chat template) written by save_pretrained, to try model.type qwen3_asr where no download is possible.

    python tools/make_random_qwen3_asr.py exp/qwen3_asr_tiny
    west-train --config recipes/aishell/conf/qwen3_asr_lora.yaml --model.path exp/qwen3_asr_tiny ...
"""
from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write")
    p.add_argument("--n_mels", type=int, default=128, help="mel bins (the released models read 128)")
    p.add_argument("--n_window_infer", type=int, default=800,
                   help="mel frames per attention window (800 as released; a multiple of 100)")
    a = p.parse_args(argv)
    from west.models.random_qwen3_asr import write_random_qwen3_asr

    t0 = time.perf_counter()
    write_random_qwen3_asr(a.out, n_mels=a.n_mels, n_window_infer=a.n_window_infer)
    print(f"make_random_qwen3_asr: tiny Qwen3-ASR with random weights in {a.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
