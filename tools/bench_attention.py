#!/usr/bin/env python
"""Benchmark (not a test): what packing-exact attention and a packed encoder cost on CPU.

1. LLM-style causal attention, forward+backward, over one packed row of
   ``--packed-len`` tokens cut into ~``--seg-len``-token segments:
   per-segment SDPA (west's CPU/any-device fallback, exact lengths and bucketed)
   vs SDPA over the whole row with a dense block-diagonal mask.
2. Conformer forward+backward on AIShell-like utterances (lognormal durations,
   mean ≈ 4.5 s, clipped to [1.2, 15] s, 100 fbank frames/s) in random order:
   packed (ΣT frames) vs padded (N × Tmax frames, what WEST's pack mode runs).

Prints a markdown table and writes JSON. Example:
    .venv/bin/python tools/bench_attention.py --out exp/bench/attention.json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from west.models.attention import SegmentPlan, reference_attention, segment_sdpa
from west.models.config import ConformerConfig
from west.models.conformer import ConformerEncoder
from west.shapes import subsampled_frames

CONF = Path(__file__).resolve().parents[1] / "recipes" / "aishell" / "conf"


def timeit(fn, reps: int, warmup: int = 1) -> dict:
    """Median wall time and median process CPU time. On a shared machine, CPU time of a
    1-thread run is the robust measure of work; wall time is what a user waits."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return dict(median_ms=1000 * statistics.median(wall), cpu_ms=1000 * statistics.median(cpu), reps=reps)


def segment_lengths(total: int, mean: int, rng: random.Random) -> list[int]:
    lens = []
    while sum(lens) < total:
        lens.append(min(rng.randint(mean // 2, mean * 3 // 2), total - sum(lens)))
    return lens


def bench_attention(args, rng) -> list[dict]:
    lens = segment_lengths(args.packed_len, args.seg_len, rng)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    total, hq, hkv, d = args.packed_len, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv))
    doc = torch.searchsorted(cu[1:].long(), torch.arange(total), right=True)
    dense_mask = (doc[:, None] == doc[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()

    def dense():
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=dense_mask, enable_gqa=True)
        out.sum().backward()
        return out[0].transpose(0, 1)

    def seg(plan):
        def fn():
            out = segment_sdpa(q, k, v, plan, causal=True)
            out.sum().backward()
            return out
        return fn

    plans = {"segment SDPA (exact lengths)": SegmentPlan.from_lengths(lens),
             "segment SDPA (8 buckets/octave)": SegmentPlan.from_lengths(lens, buckets_per_octave=8)}
    ref = reference_attention(q.detach(), k.detach(), v.detach(), cu, causal=True)
    rows = []
    base = timeit(dense, args.reps)
    with torch.no_grad():
        fwd_dense = timeit(lambda: F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=dense_mask, enable_gqa=True), args.reps)
    rows.append(dict(case="dense block-diagonal SDPA", fwd_bwd_ms=base["median_ms"], fwd_bwd_cpu_ms=base["cpu_ms"],
                     fwd_ms=fwd_dense["median_ms"], speedup=1.0, speedup_cpu=1.0,
                     max_abs_err=float((dense().detach().double() - ref).abs().max())))
    for name, plan in plans.items():
        t = timeit(seg(plan), args.reps)
        with torch.no_grad():
            f = timeit(lambda: segment_sdpa(q, k, v, plan, causal=True), args.reps)
        rows.append(dict(case=name, fwd_bwd_ms=t["median_ms"], fwd_bwd_cpu_ms=t["cpu_ms"], fwd_ms=f["median_ms"],
                         groups=len(plan.groups), speedup=base["median_ms"] / t["median_ms"],
                         speedup_cpu=base["cpu_ms"] / t["cpu_ms"],
                         max_abs_err=float((seg(plan)().detach().double() - ref).abs().max())))
    meta = dict(packed_len=total, segments=len(lens), mean_seg_len=total / len(lens), heads=hq, kv_heads=hkv,
                head_dim=d, dtype="float32")
    return [dict(meta, **r) for r in rows]


def aishell_frames(n: int, rng: random.Random, mean_s=4.5, sigma=0.45, lo=1.2, hi=15.0) -> list[int]:
    mu = math.log(mean_s) - sigma ** 2 / 2
    return [int(100 * min(hi, max(lo, rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def bench_encoder(args, rng) -> list[dict]:
    section = yaml.safe_load(Path(args.enc_config).read_text())["model"]["encoder"]
    cfg = ConformerConfig.from_dict({**section, "num_blocks": args.enc_blocks, "dropout": 0.0})
    torch.manual_seed(0)
    enc = ConformerEncoder(cfg).train()
    lens = aishell_frames(args.enc_utts, rng)
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(n, cfg.input_dim, generator=g) for n in lens]
    packed = torch.cat(feats)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    padded = torch.zeros(len(lens), max(lens), cfg.input_dim)
    for i, f in enumerate(feats):
        padded[i, : len(f)] = f
    lengths = torch.tensor(lens)

    def run_packed():
        out, _ = enc(packed, cu_seqlens=cu)
        out.square().mean().backward()

    def run_padded():
        out, _ = enc(padded, lengths=lengths)
        out.square().mean().backward()

    t_pack, t_pad = timeit(run_packed, args.enc_reps), timeit(run_padded, args.enc_reps)
    real = sum(lens)
    params = sum(p.numel() for p in enc.parameters())
    meta = dict(utterances=len(lens), mean_dur_s=real / len(lens) / 100, max_dur_s=max(lens) / 100,
                encoder=f"{Path(args.enc_config).name} d={cfg.d_model} ff={cfg.ffn_dim} blocks={cfg.num_blocks}",
                params_M=params / 1e6, real_frames=real,
                real_enc_frames=sum(subsampled_frames(n, cfg.subsampling_rate) for n in lens))
    return [
        dict(meta, layout="padded (N x Tmax)", computed_frames=padded.shape[0] * padded.shape[1],
             useful=real / (padded.shape[0] * padded.shape[1]), fwd_bwd_ms=t_pad["median_ms"],
             fwd_bwd_cpu_ms=t_pad["cpu_ms"], speedup=1.0, speedup_cpu=1.0),
        dict(meta, layout="packed (sum T)", computed_frames=real, useful=1.0,
             fwd_bwd_ms=t_pack["median_ms"], fwd_bwd_cpu_ms=t_pack["cpu_ms"],
             speedup=t_pad["median_ms"] / t_pack["median_ms"], speedup_cpu=t_pad["cpu_ms"] / t_pack["cpu_ms"]),
    ]


def _loadavg():
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--packed-len", type=int, default=4096)
    p.add_argument("--seg-len", type=int, default=200)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--enc-config", default=str(CONF / "seed_gpu.yaml"), help="a run YAML: its model.encoder")
    p.add_argument("--enc-blocks", type=int, default=4)
    p.add_argument("--enc-utts", type=int, default=32)
    p.add_argument("--enc-reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-encoder", action="store_true")
    p.add_argument("--out", default="exp/bench/attention.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)

    result = dict(torch=torch.__version__, threads=args.threads, machine=platform.processor() or platform.machine(),
                  loadavg_start=_loadavg(), attention=bench_attention(args, rng))
    a = result["attention"][0]
    print(f"\n### Packed causal attention, fwd+bwd, CPU ({args.threads} threads): {a['packed_len']} tokens, "
          f"{a['segments']} segments (mean {a['mean_seg_len']:.0f}), {a['heads']}/{a['kv_heads']} heads x {a['head_dim']}\n")
    print("| backend | fwd+bwd wall ms | fwd+bwd CPU ms | fwd wall ms | speed-up (wall / CPU) | max abs err vs fp64 |")
    print("|---|---|---|---|---|---|")
    for r in result["attention"]:
        print(f"| {r['case']} | {r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_cpu_ms']:.1f} | {r['fwd_ms']:.1f} | "
              f"{r['speedup']:.1f}x / {r['speedup_cpu']:.1f}x | {r['max_abs_err']:.1e} |")
    if not args.skip_encoder:
        result["encoder"] = bench_encoder(args, rng)
        e = result["encoder"][0]
        print(f"\n### Conformer fwd+bwd, CPU: {e['utterances']} AIShell-like utterances in random order "
              f"(mean {e['mean_dur_s']:.2f} s, max {e['max_dur_s']:.2f} s), {e['encoder']} ({e['params_M']:.1f}M)\n")
        print("| encoder layout | computed fbank frames | useful | fwd+bwd wall ms | fwd+bwd CPU ms | "
              "speed-up (wall / CPU) |")
        print("|---|---|---|---|---|---|")
        for r in result["encoder"]:
            print(f"| {r['layout']} | {r['computed_frames']} | {100 * r['useful']:.0f}% | {r['fwd_bwd_ms']:.0f} | "
                  f"{r['fwd_bwd_cpu_ms']:.0f} | {r['speedup']:.2f}x / {r['speedup_cpu']:.2f}x |")
    result["loadavg_end"] = _loadavg()
    print(f"\nload average (1 min) at start/end: {result['loadavg_start']} / {result['loadavg_end']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
