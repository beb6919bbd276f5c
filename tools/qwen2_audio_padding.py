#!/usr/bin/env python3
"""What running Qwen2-Audio's audio tower per utterance (packed) changes against the 30 s padding
it was pretrained with: the output difference, measured, and the tower FLOPs removed, by arithmetic.

1. Difference: each utterance through the tower alone (west's packed path) and padded to 3000
   frames as transformers runs it (model.encoder.pad_to_30s: padded frames masked out of the
   attention, but the convolutions see the padding). Default: a tiny random tower
   (west.models.random_qwen2_audio); ``--path DIR`` measures a real download instead.
2. FLOPs: west.bench.tower_flops at the published Qwen2-Audio-7B tower shape for AIShell-like
   utterance lengths (AIShell-1's mean is 4.5 s; its train set runs ~1-15 s).

    python tools/qwen2_audio_padding.py --out exp/q2a_padding.json
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np

SECONDS = (1.0, 2.0, 4.5, 8.0, 15.0, 29.0)


def speech_like(seconds: float, seed: int) -> np.ndarray:
    """A voiced-sounding 16 kHz wave: a gliding harmonic tone under a syllable-rate envelope, plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    f0 = 110 + 60 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6))
    phase = 2 * np.pi * np.cumsum(f0) / 16000
    wave = sum(np.sin(k * phase) / k for k in range(1, 11))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t + rng.uniform(0, 6)) ** 2
    return (0.1 * wave * envelope + 0.01 * rng.standard_normal(t.shape)).astype(np.float32)


def measure_difference(path: str, seconds=SECONDS) -> list[dict]:
    import torch

    from west.data.whisper_features import whisper_log_mel
    from west.models.qwen2_audio import Qwen2AudioPackedEncoder, load_hf_qwen2_audio_tower, qwen2_audio_geometry

    n_mels = qwen2_audio_geometry(path)[0]
    packed = Qwen2AudioPackedEncoder(load_hf_qwen2_audio_tower(path), path).eval()
    padded = Qwen2AudioPackedEncoder(load_hf_qwen2_audio_tower(path), path, pad_to_30s=True).eval()
    rows = []
    for i, s in enumerate(seconds):
        mel = torch.from_numpy(whisper_log_mel(speech_like(s, i), n_mels))
        lens = torch.tensor([mel.shape[0]])
        with torch.no_grad():
            a = packed.forward_flat(mel[None], lengths=lens)[0].double()
            b = padded.forward_flat(mel[None], lengths=lens)[0].double()
        diff = (a - b).norm(dim=-1) / b.norm(dim=-1)
        rows.append({"seconds": s, "mel_frames": int(mel.shape[0]), "tower_frames": int(a.shape[0]),
                     "rel_rms": float((a - b).norm() / b.norm()), "max_frame_rel": float(diff.max()),
                     "last_frame_rel": float(diff[-1]), "max_other_frame_rel": float(diff[:-1].max()),
                     "frames_over_1pct": float((diff > 0.01).double().mean()),
                     "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())})
    return rows


def flop_rows(seconds=SECONDS) -> list[dict]:
    from west.bench.tower_flops import QWEN2_AUDIO_7B, WINDOW_FRAMES, padding_saving, tower_flops

    full = tower_flops(WINDOW_FRAMES, QWEN2_AUDIO_7B)
    return [{"seconds": s, "gflops_packed": tower_flops(round(s * 100), QWEN2_AUDIO_7B) / 1e9,
             "gflops_padded": full / 1e9, "saving": padding_saving(round(s * 100), QWEN2_AUDIO_7B)} for s in seconds]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", help="a Qwen2-Audio directory (default: a tiny random one)")
    p.add_argument("--out", type=Path, help="write the two tables as JSON here")
    a = p.parse_args(argv)

    import torch

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        if a.path:
            path, what = a.path, a.path
        else:
            from west.models.random_qwen2_audio import write_random_qwen2_audio

            path = write_random_qwen2_audio(Path(tmp) / "q2a", n_mels=128, d_model=64, layers=4)
            what = "tiny random tower (d_model 64, 4 layers, 128 mels, weights N(0, 0.2))"
        diffs = measure_difference(path)
    flops = flop_rows()
    print(f"1. packed vs padded to 30 s, {what}, float32")
    print(f"{'s':>5} {'mel':>5} {'out':>4} {'rel RMS':>9} {'last frame':>10} {'worst other':>11} {'frames >1%':>10} {'cosine':>8}")
    for r in diffs:
        print(f"{r['seconds']:5.1f} {r['mel_frames']:5d} {r['tower_frames']:4d} {r['rel_rms']:9.2e} "
              f"{r['last_frame_rel']:10.2e} {r['max_other_frame_rel']:11.2e} {100 * r['frames_over_1pct']:9.1f}% {r['cosine']:8.5f}")
    print("2. Qwen2-Audio-7B tower (d_model 1280, 32 layers, FFN 5120, 128 mels), forward FLOPs per utterance")
    print(f"{'s':>5} {'packed GFLOP':>12} {'30 s GFLOP':>10} {'removed':>8}")
    for r in flops:
        print(f"{r['seconds']:5.1f} {r['gflops_packed']:12.1f} {r['gflops_padded']:10.1f} {100 * r['saving']:7.1f}%")
    mean = next(r for r in flops if math.isclose(r["seconds"], 4.5))
    print(f"qwen2_audio_padding: at AIShell-1's mean 4.5 s the packed tower does {mean['gflops_packed']:.0f} of "
          f"{mean['gflops_padded']:.0f} GFLOP ({100 * mean['saving']:.0f} % removed); output differs by "
          f"{next(r for r in diffs if math.isclose(r['seconds'], 4.5))['rel_rms']:.1e} relative RMS ({what})")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"model": what, "difference": diffs, "flops_qwen2_audio_7b": flops}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
