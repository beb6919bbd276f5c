"""A frozen SwiGLU MLP alone, stock against ``model.llm.fused_swiglu``: time and kept memory.

At Qwen2-1.5B's widths (hidden 1,536, intermediate 8,960) and a pack's rows, two measurements:

* the elementwise work between the products alone, forward and backward: the stock operators
  (``silu(g) * u``; ``silu_backward(dh * u, g)``, ``dh * silu(g)``) against the two compiled
  functions of west.models.fused_swiglu;
* the whole MLP forward + backward (input gradient only, the weights frozen) as the model runs it,
  through ``FrozenSwiGLU`` fused (gate and up kept), and both again recomputing gate and up
  (``checkpoint_scope: mlp``), with the bytes each keeps for its backward.

Times are medians of drained milliseconds (west.bench.timing). A benchmark: it prints a table and
writes JSON, and asserts nothing.

    python tools/bench_swiglu.py [--rows 8192] [--hidden 1536] [--intermediate 8960] [--dtype bf16]
        [--device cuda] [--repeats 10] [--out swiglu.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from west.bench.timing import host_and_device_ms
from west.models.fused_swiglu import fused
from west.models.mlp_checkpoint import FrozenSwiGLU

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def elementwise(rows: int, width: int, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    """Forward + backward ms of the elementwise work alone, stock and fused."""
    g, u, dh = (torch.randn(rows, width, dtype=dtype, device=device) for _ in range(3))

    def stock() -> None:
        F.silu(g) * u
        torch.ops.aten.silu_backward(dh * u, g)
        dh * F.silu(g)

    def fused_pair() -> None:
        fused("silu_mul")(g, u)
        fused("swiglu_grads")(dh, g, u)

    return {name: host_and_device_ms(fn, device, repeats)[1] for name, fn in (("stock", stock), ("fused", fused_pair))}


def whole_mlp(rows: int, hidden: int, width: int, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    """Forward + backward ms and kept MiB of the frozen MLP per variant."""
    gen = torch.Generator(device=device).manual_seed(0)
    ws = [torch.randn(width, hidden, dtype=dtype, device=device, generator=gen) / hidden ** 0.5,
          torch.randn(width, hidden, dtype=dtype, device=device, generator=gen) / hidden ** 0.5,
          torch.randn(hidden, width, dtype=dtype, device=device, generator=gen) / width ** 0.5]
    x = torch.randn(rows, hidden, dtype=dtype, device=device, generator=gen, requires_grad=True)
    grad = torch.randn(rows, hidden, dtype=dtype, device=device, generator=gen)

    def stock_mlp(t: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(t, ws[0])) * F.linear(t, ws[1]), ws[2])

    variants = {"stock": stock_mlp,
                "fused (gate and up kept)": lambda t: FrozenSwiGLU.apply(t, *ws, False, True),
                "recomputed (checkpoint_scope mlp)": lambda t: FrozenSwiGLU.apply(t, *ws, True, False),
                "recomputed and fused": lambda t: FrozenSwiGLU.apply(t, *ws, True, True)}
    out = {}
    for name, fn in variants.items():
        def step() -> None:
            x.grad = None
            fn(x).backward(grad)

        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            fn(x)
        resident = {w.data_ptr() for w in ws} | {x.data_ptr()}
        kept_mib = sum(t.numel() * t.element_size() for t in kept if t.data_ptr() not in resident) / 2**20
        out[name] = {"ms": host_and_device_ms(step, device, repeats)[1], "kept_mib": kept_mib}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--intermediate", type=int, default=8960)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
           "rows": a.rows, "hidden": a.hidden, "intermediate": a.intermediate, "dtype": a.dtype,
           "elementwise_ms": elementwise(a.rows, a.intermediate, dtype, device, a.repeats),
           "mlp": whole_mlp(a.rows, a.hidden, a.intermediate, dtype, device, a.repeats)}
    ew = res["elementwise_ms"]
    print(f"### A frozen SwiGLU MLP on {res['device']}: {a.rows:,} rows, hidden {a.hidden:,}, intermediate "
          f"{a.intermediate:,}, {a.dtype}\n")
    print(f"elementwise work alone, forward + backward: stock {ew['stock']:.2f} ms, fused {ew['fused']:.2f} ms\n")
    print("| MLP, forward + backward | ms | kept for the backward beyond its input, MiB |\n|---|---|---|")
    for name, v in res["mlp"].items():
        print(f"| {name} | {v['ms']:.2f} | {v['kept_mib']:,.1f} |")
    if a.out:
        a.out.write_text(json.dumps(res, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
