"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine schedule."""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases, norm gains and other vectors/scalars (ndim < 2) get no weight decay:
    decaying a LayerNorm/RMSNorm gain towards 0 only hurts. Embeddings are decayed."""
    return param.ndim < 2


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices and undecayed vectors; frozen params are left out."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (keep if no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": keep, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] | list[float] = (0.9, 0.999),
                    eps: float = 1e-8) -> torch.optim.AdamW:
    groups = param_groups(model, weight_decay)
    if not groups:
        raise ValueError("model has no trainable parameters")
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """lr multiplier for optimizer step ``s`` (0-based): linear ramp (s+1)/warmup, then cosine
    from 1 to ``min_ratio`` at ``total_steps``; constant after warmup if total_steps <= 0
    (epoch-limited runs whose length is not known up front)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    min_ratio: float = 0.0) -> LambdaLR:
    """LambdaLR over a closure: its state_dict holds only counters, so a resumed run may
    change max_steps and the schedule follows the new value."""
    return LambdaLR(optimizer, warmup_cosine(warmup_steps, total_steps, min_ratio))
