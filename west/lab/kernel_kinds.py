"""GPU kernels by what they do, from their names: a trace's kernel time in the categories of
west.lab.roofline's floor, so that each category's measured time can be set against its floor.

Names are matched in order (the first category whose pattern matches wins): cuBLAS/cuDNN/CUTLASS
products and convolutions, flash/fused attention, the optimizer's multi-tensor kernels, norms,
copies (casts, concatenation, indexing, memcpy/memset), and everything else (elementwise kernels,
reductions, inductor's fused ``triton_*`` kernels)."""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Sequence

OTHER = "elementwise and reductions"
PATTERNS = (   # (category, pattern) in matching order
    ("attention", r"flash|fmha|attention"),
    ("optimizer", r"multi_tensor_apply|fused_adam|adamw"),
    ("norms", r"layer_?norm|rms_?norm|batch_?norm"),
    ("products", r"gemm|nvjet|cutlass|xmma|cublas|cudnn|implicit_convolve|conv_depthwise|convolution|winograd"),
    ("copies and casts", r"memcpy|memset|copy|catarray|\bcat\b|index|gather|scatter|embedding|pad"),
)
CATEGORIES = (*(c for c, _ in PATTERNS), OTHER)
_COMPILED = tuple((c, re.compile(p, re.IGNORECASE)) for c, p in PATTERNS)


def kernel_category(name: str) -> str:
    return next((c for c, pattern in _COMPILED if pattern.search(name)), OTHER)


def by_category(gpu_events: Sequence[dict], steps: int) -> dict[str, dict]:
    """Per category: kernels and their summed ms per step, over the GPU events of ``steps`` steps."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in gpu_events:
        c = out[kernel_category(e.get("name", ""))]
        c[0] += 1
        c[1] += e["dur"] / 1e3
    n = max(int(steps), 1)
    return {c: {"kernels_per_step": out[c][0] / n, "ms_per_step": out[c][1] / n} for c in CATEGORIES if c in out}


def category_table(cats: dict[str, dict], floors_ms: dict[str, float] | None = None) -> str:
    """Markdown: per category the kernels and their ms per step, and where given the floor's ms and
    the kernels' time over it."""
    floors_ms = floors_ms or {}
    lines = ["| kernels by category | kernels per step | kernel ms per step | floor ms | kernel time / floor |",
             "|---|---|---|---|---|"]
    for c, v in sorted(cats.items(), key=lambda kv: -kv[1]["ms_per_step"]):
        floor = floors_ms.get(c)
        ratio = f"{v['ms_per_step'] / floor:.1f}x" if floor else "–"
        lines.append(f"| {c} | {v['kernels_per_step']:,.0f} | {v['ms_per_step']:.1f} | "
                     f"{'–' if floor is None else f'{floor:.1f}'} | {ratio} |")
    total = sum(v["ms_per_step"] for v in cats.values())
    floor_total = sum(floors_ms.values())
    lines.append(f"| **all kernels** | {sum(v['kernels_per_step'] for v in cats.values()):,.0f} | {total:.1f} | "
                 f"{f'{floor_total:.1f}' if floors_ms else '–'} | "
                 f"{f'{total / floor_total:.1f}x' if floor_total else '–'} |")
    return "\n".join(lines)
