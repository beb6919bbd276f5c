#!/usr/bin/env python3
"""The packed Conformer's attention, every backend against a float64 reference, then timed.

One ``RelPositionAttention`` (the seed's 256-d, 4 heads by default; both ``pos_enc``
variants) over packed utterances of AIShell-like encoder lengths: relative error of the
output and of the gradients (input rows, ``pos_bias_u/v``, ``linear_pos``: the last three
reach FlexAttention through its ``score_mod``) against the same module in float64 with
exact-length segment SDPA; then forward + backward time and the number of GPU kernels per
call (torch.profiler) for: flex, segment SDPA with 8 buckets per octave, and with one group;
for ``wenet`` also its positional term folded into q and k through the cu_seqlens kernel ``auto``
picks on CUDA (flash-attn, else torch's; off CUDA flash-attn's torch reference).
On a CPU it checks the forward only for flex (torch has no CPU backward for it).
Not a test: a table and a JSON.

    python tools/check_encoder_attention.py --out encoder_attention.json
"""
from __future__ import annotations

import argparse
import copy
import json

import torch

from west.bench.kernel_checks import random_lengths, relative_error
from west.bench.timing import median_ms
from west.models.attention import bucket_length
from west.models.config import ConformerConfig
from west.models.conformer import RelPositionAttention, relative_sinusoids
from west.models.layout import FrameLayout

VARIANTS = {"flex": ("flex", 8), "sdpa_segments (8/octave)": ("sdpa_segments", 8),
            "sdpa_segments (one group)": ("sdpa_segments", 0),
            "varlen (wenet: pos in q, k)": ("varlen", 0)}   # pos_enc wenet only: a cu_seqlens kernel


def run(module: RelPositionAttention, x: torch.Tensor, lens: list[int], buckets) -> torch.Tensor:
    layout = FrameLayout(lens, x.device, buckets_per_octave=buckets)
    longest = bucket_length(max(lens), buckets, max(lens))   # as ConformerEncoder.encode sizes its table
    table = relative_sinusoids(longest, x.shape[-1]).to(x.device, x.dtype)
    return module(x, layout, module.positional(layout, table, module.route(x, layout)))


def check(module, variant: str, lens, dtype, device, seed: int, train: bool) -> dict:
    backend, buckets = VARIANTS[variant]
    gen = torch.Generator().manual_seed(seed)
    x64 = torch.randn(sum(lens), module.linear_q.in_features, generator=gen, dtype=torch.float64)
    gout = torch.randn(x64.shape, generator=gen, dtype=torch.float64)
    ref_mod = copy.deepcopy(module).double().cpu()
    ref_mod.backend = "sdpa_segments"
    xr = x64.clone().requires_grad_(True)
    ref = run(ref_mod, xr, lens, None)
    ref.backward(gout)
    mod = copy.deepcopy(module).to(device)
    mod.backend = backend
    xt = x64.to(device, dtype).requires_grad_(train)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32), torch.set_grad_enabled(train):
        out = run(mod, xt, lens, buckets)
    res = {"out": relative_error(out.float(), ref), "nan": bool(torch.isnan(out).any())}
    if train:
        out.float().backward(gout.to(device).float())
        res["dx"] = relative_error(xt.grad, xr.grad)
        for name in ("pos_bias_u", "pos_bias_v", "linear_pos.weight", "linear_q.weight"):
            got, want = mod.get_parameter(name).grad, ref_mod.get_parameter(name).grad
            res[f"d{name}"] = relative_error(got, want)
    return res


def time_and_kernels(module, variant: str, lens, dtype, device, repeats: int) -> tuple[float, int]:
    backend, buckets = VARIANTS[variant]
    mod = copy.deepcopy(module).to(device)
    mod.backend = backend
    x = torch.randn(sum(lens), module.linear_q.in_features, device=device, requires_grad=True)
    g = torch.randn(x.shape, device=device)

    def once():
        x.grad = None
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = run(mod, x, lens, buckets)
        out.float().backward(g)

    ms = median_ms(once, device, repeats)
    kernels = 0
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            once()
            torch.cuda.synchronize()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    return ms, kernels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--check_rows", type=int, default=1500, help="encoder frames per correctness check")
    p.add_argument("--time_rows", type=int, default=10000, help="encoder frames per timed pack (~8192 LLM tokens)")
    p.add_argument("--seg", default="25,250", help="utterance length range lo,hi in encoder frames")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON file for the full numbers")
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    lo, hi = (int(x) for x in a.seg.split(","))
    gen = torch.Generator().manual_seed(0)
    train = device.type == "cuda"
    rows = []
    for pos_enc in ("relative", "wenet"):
        torch.manual_seed(0)
        cfg = ConformerConfig(d_model=a.d_model, num_heads=a.heads, pos_enc=pos_enc)
        module = RelPositionAttention(cfg.d_model, cfg.num_heads, 0.0, pos_enc)
        for variant in VARIANTS:
            if VARIANTS[variant][0] == "varlen" and pos_enc != "wenet":
                continue
            row = {"pos_enc": pos_enc, "variant": variant}
            try:
                row["checks"] = [check(module, variant, random_lengths(a.check_rows, lo, hi, gen), dtype, device, s,
                                       train or VARIANTS[variant][0] != "flex") for s in (1, 2)]
                row["worst"] = max(v for c in row["checks"] for k, v in c.items() if k != "nan")
                row["nan"] = any(c["nan"] for c in row["checks"])
                row["ms"], row["kernels"] = time_and_kernels(module, variant, random_lengths(a.time_rows, lo, hi, gen),
                                                             dtype, device, a.repeats) if train else (None, 0)
            except Exception as e:  # report and go on: one broken path must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nConformer attention on {name}, {a.dtype}, {a.d_model}-d x {a.heads} heads, torch {torch.__version__}"
          f"{'' if train else ' (forward only: no timing on the CPU)'}")
    print(f"{'pos_enc':<9} {'variant':<28} {'worst rel err':>14} {'fwd+bwd ms':>11} {'kernels':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['pos_enc']:<9} {r['variant']:<28} {r['error']}")
            continue
        ms = f"{r['ms']:.2f}" if r["ms"] is not None else "-"
        print(f"{r['pos_enc']:<9} {r['variant']:<28} {r['worst']:>14.2e} {ms:>11} {r['kernels'] or '-':>8}"
              + ("  NaN!" if r["nan"] else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": name, "dtype": a.dtype, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
