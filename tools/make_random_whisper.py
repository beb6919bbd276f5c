#!/usr/bin/env python3
"""A randomly initialised Whisper of a published shape, written with ``save_pretrained``.

No weights can be downloaded here; this builds ``WhisperForConditionalGeneration`` from the
published configuration values (encoder width, depth, heads, mel bins) with random weights,
so the packed encoder, the 30 s padded baseline and the benchmark run at the real shapes.

    python tools/make_random_whisper.py exp/whisper_tiny --shape tiny
"""
from __future__ import annotations

import argparse
from pathlib import Path

# Published config.json values (openai/whisper-*), encoder and decoder alike.
SHAPES = {
    "tiny": dict(d_model=384, layers=4, heads=6, ffn=1536, num_mel_bins=80),
    "base": dict(d_model=512, layers=6, heads=8, ffn=2048, num_mel_bins=80),
    "small": dict(d_model=768, layers=12, heads=12, ffn=3072, num_mel_bins=80),
    "large-v3": dict(d_model=1280, layers=32, heads=20, ffn=5120, num_mel_bins=128),
}


def build(out: Path, shape: str, seed: int, device: str = "cpu") -> int:
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    s = SHAPES[shape]
    conf = WhisperConfig(d_model=s["d_model"], encoder_layers=s["layers"], decoder_layers=s["layers"],
                         encoder_attention_heads=s["heads"], decoder_attention_heads=s["heads"],
                         encoder_ffn_dim=s["ffn"], decoder_ffn_dim=s["ffn"], num_mel_bins=s["num_mel_bins"],
                         max_source_positions=1500)
    torch.manual_seed(seed)
    with torch.device(device):   # a GPU draws the weights much faster than a CPU
        model = WhisperForConditionalGeneration(conf)
    model.save_pretrained(str(out))
    return sum(p.numel() for p in model.model.encoder.parameters())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where to draw the weights (cuda: much faster)")
    a = p.parse_args(argv)
    n = build(a.out, a.shape, a.seed, a.device)
    print(f"make_random_whisper: whisper-{a.shape} shape with random weights, encoder {n / 1e6:.1f} M parameters -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
