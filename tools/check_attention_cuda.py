#!/usr/bin/env python3
"""Every packed-attention backend against the float64 block-diagonal reference, then timed.

For each backend that can run here: relative error ‖out − ref‖ / ‖ref‖ of the output and of
the q/k/v gradients on fresh random inputs (segments of random lengths, Qwen2-1.5B heads by
default), and, but for flex, one row whose samples share a 14-token prompt prefix through key rows
(data.shared_prefix: causal aligned bottom-right, against flash-attn's semantics in float64); then
the median time of forward + backward over a pack of ``--time_tokens`` rows. Written for a GPU (bf16); on CPU it checks what CPU runs. Not a test: a table and a JSON.

    python tools/check_attention_cuda.py --out attention_check.json
"""
from __future__ import annotations

import argparse
import json

import torch

from west.bench.kernel_checks import random_lengths, relative_error
from west.bench.timing import median_ms
from west.models.attention import BACKENDS, reference_attention, varlen_attention
from west.models.flash_reference import flash_attn_varlen_reference
from west.models.shared_prefix import prefix_row
from west.models.varlen_kernels import _flash_kernel, _torch_varlen_kernel, choose_backend


def cu_of(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def usable(backend: str, device: torch.device) -> bool:
    if backend == "flash":
        return device.type == "cuda" and _flash_kernel() is not None
    if backend == "torch_varlen":
        return device.type == "cuda" and _torch_varlen_kernel() is not None
    if backend == "flex":
        return device.type == "cuda"   # no CPU backward
    return True


def compare(run, reference, rows: int, hq: int, hkv: int, d: int, dtype, device, seed: int) -> dict:
    """``run(q, k, v)`` on ``dtype`` inputs against ``reference(q, k, v)`` in float64: relative errors
    of the output and of the q/k/v gradients for one random output gradient, and whether any is NaN."""
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(rows, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv)]
    x = [t.to(device, dtype).requires_grad_(True) for t in base]
    out = run(*x)
    gout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(gout.to(device, dtype))
    r = [t.to(device).requires_grad_(True) for t in base]
    ref = reference(*r)
    ref.backward(gout.to(device))
    res = {"out": relative_error(out, ref)}
    for name, a, b in zip("qkv", x, r):
        res[f"d{name}"] = relative_error(a.grad, b.grad)
    res["nan"] = bool(torch.isnan(out).any()) or any(bool(torch.isnan(t.grad).any()) for t in x)
    return res


def check(backend: str, lens: list[int], hq: int, hkv: int, d: int, dtype, device, causal: bool, seed: int) -> dict:
    cu = cu_of(lens, device)
    return compare(lambda q, k, v: varlen_attention(q, k, v, cu, max(lens), causal=causal, backend=backend),
                   lambda q, k, v: reference_attention(q, k, v, cu, causal=causal),
                   sum(lens), hq, hkv, d, dtype, device, seed)


def check_shared_prefix(backend: str, prefix: int, lens: list[int], hq: int, hkv: int, d: int, dtype, device,
                        seed: int) -> dict:
    """A row [prefix | samples] whose samples attend to the prefix through key rows (data.shared_prefix):
    causal aligned bottom-right, against flash-attn's semantics in float64 on the gathered keys."""
    cu, keys = prefix_row(prefix, lens, device)
    longest = max(prefix, *lens)
    return compare(lambda q, k, v: varlen_attention(q, k, v, cu, longest, causal=True, backend=backend, keys=keys),
                   lambda q, k, v: flash_attn_varlen_reference(q, k[keys.index], v[keys.index], cu, keys.cu_seqlens,
                                                               longest, keys.max_seqlen, causal=True),
                   prefix + sum(lens), hq, hkv, d, dtype, device, seed)


def time_backend(backend: str, lens: list[int], hq: int, hkv: int, d: int, dtype, device, repeats: int) -> float:
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, device=device, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
    cu = cu_of(lens, device)
    g = torch.randn(total, hq, d, device=device, dtype=dtype)

    def once():
        for t in (q, k, v):
            t.grad = None
        varlen_attention(q, k, v, cu, max(lens), causal=True, backend=backend).backward(g)

    return median_ms(once, device, repeats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--heads", default="12,2,128", help="Hq,Hkv,D (Qwen2-1.5B: 12,2,128)")
    p.add_argument("--check_tokens", type=int, default=2048, help="rows per correctness check")
    p.add_argument("--time_tokens", type=int, default=8192, help="rows per timed pack")
    p.add_argument("--seg", default="20,300", help="segment length range lo,hi")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON file for the full numbers")
    p.add_argument("--shared_prefix_only", action="store_true",
                   help="only the shared-prompt-prefix check of each backend (data.shared_prefix), untimed")
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    lo, hi = (int(x) for x in a.seg.split(","))
    gen = torch.Generator().manual_seed(0)
    auto = choose_backend(device, dtype)
    rows = []
    for backend in [b for b in BACKENDS if b != "auto"]:
        if not usable(backend, device):
            rows.append({"backend": backend, "skipped": "not available here"})
            continue
        row = {"backend": backend, "checks": []}
        if a.shared_prefix_only and backend == "flex":
            rows.append({"backend": backend, "skipped": "takes no shared prefix"})
            continue
        try:
            for seed, causal in () if a.shared_prefix_only else ((1, True), (2, False), (3, True)):
                lens = random_lengths(a.check_tokens, lo, hi, gen)
                row["checks"].append({"causal": causal, **check(backend, lens, hq, hkv, d, dtype, device, causal, seed)})
            if backend != "flex":   # a shared prompt prefix of Qwen2-Instruct's 14 tokens
                lens = random_lengths(a.check_tokens, lo, hi, gen)
                row["checks"].append({"causal": True, "shared_prefix": 14,
                                      **check_shared_prefix(backend, 14, lens, hq, hkv, d, dtype, device, 4)})
            row["worst"] = max(max(c[k] for k in ("out", "dq", "dk", "dv")) for c in row["checks"])
            row["nan"] = any(c["nan"] for c in row["checks"])
            row["ms"] = float("nan") if a.shared_prefix_only else time_backend(
                backend, random_lengths(a.time_tokens, lo, hi, gen), hq, hkv, d, dtype, device, a.repeats)
        except Exception as e:  # report and go on: one broken kernel must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\npacked attention on {name}, {a.dtype}, heads {hq}/{hkv}x{d}, torch {torch.__version__}; "
          f"auto picks: {auto}")
    print(f"{'backend':<14} {'worst rel err (out, dq, dk, dv)':>32} {'fwd+bwd ms @' + str(a.time_tokens):>18}")
    for r in rows:
        if "skipped" in r or "error" in r:
            print(f"{r['backend']:<14} {r.get('skipped') or r.get('error')}")
        else:
            print(f"{r['backend']:<14} {r['worst']:>32.2e} {r['ms']:>18.2f}" + ("  NaN!" if r["nan"] else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": name, "dtype": a.dtype, "torch": torch.__version__, "auto": auto,
                       "heads": [hq, hkv, d], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
