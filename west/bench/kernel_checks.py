"""What the attention-kernel checks (tools/check_attention_cuda.py, tools/check_encoder_attention.py)
share: random utterance lengths and a relative error against a float64 reference (their timing is
west.bench.timing's)."""
from __future__ import annotations

import torch


def random_lengths(total: int, lo: int, hi: int, gen: torch.Generator) -> list[int]:
    """Lengths drawn uniformly from [lo, hi] until they add up to ``total`` (the last one cut to fit)."""
    out, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(lo, hi + 1, (1,), generator=gen)))
        out.append(n)
        left -= n
    return out


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 on the CPU (where the references live)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))
