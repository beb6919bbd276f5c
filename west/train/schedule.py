"""AdamW with decoupled weight decay on matrices only, one lr per module (encoder, projector,
LLM) and a warmup + cosine schedule per param group, with an optional projector-only warm-up.

Param groups: per module, projector side first (so ``param_groups[0]``, whose lr the step
record logs, is the projector's whenever the projector trains), each split into decayed
matrices and undecayed vectors. The group layout depends only on which parameters train,
never on the lr values, so a resumed run may change them without breaking the optimizer state.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from west.checkpoint.training import CheckpointError
from west.schema import ConfigError
from west.train.config import TrainConfig

# Module of a parameter, by the first component of its name (SpeechLLM's attributes): the CTC
# head and the blank embedding feed the LLM's input like the projector does, so they are on
# the projector side. Anything else (another model) is "other" and follows train.lr.
MODULES = ("projector", "encoder", "llm", "other")
OWNER = {"projector": "projector", "ctc_head": "projector", "blank_embedding": "projector",
         "encoder": "encoder", "llm": "llm"}
WRAPPERS = ("module.", "_orig_mod.")  # DDP, torch.compile (FSDP2 keeps the names)


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases, norm gains and other vectors/scalars (ndim < 2) get no weight decay:
    decaying a LayerNorm/RMSNorm gain towards 0 only hurts. Embeddings are decayed."""
    return param.ndim < 2


def module_of(name: str) -> str:
    """``encoder`` / ``projector`` / ``llm`` / ``other`` for a parameter name of a (wrapped) model."""
    while name.startswith(WRAPPERS):
        name = name.split(".", 1)[1]
    return OWNER.get(name.split(".", 1)[0], "other")


def param_groups(model: nn.Module, weight_decay: float,
                 module_lrs: Optional[dict[str, Optional[float]]] = None) -> list[dict]:
    """Per module (in MODULES order), decayed matrices then undecayed vectors; frozen params
    are left out. Each group carries ``module``; ``lr`` only where ``module_lrs`` sets one."""
    buckets: dict[tuple[str, bool], list] = {(m, d): [] for m in MODULES for d in (True, False)}
    for name, p in model.named_parameters():
        if p.requires_grad:
            buckets[(module_of(name), not no_decay(name, p))].append(p)
    groups = []
    for (module, decay), params in buckets.items():
        if params:
            g = {"params": params, "weight_decay": weight_decay if decay else 0.0, "module": module}
            if (module_lrs or {}).get(module) is not None:
                g["lr"] = module_lrs[module]
            groups.append(g)
    return groups


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] | list[float] = (0.9, 0.999), eps: float = 1e-8,
                    module_lrs: Optional[dict[str, Optional[float]]] = None) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; ``module_lrs`` = {module: lr or None (= ``lr``)}.
    A module given an lr must have trainable parameters (else the setting would do nothing)."""
    groups = param_groups(model, weight_decay, module_lrs)
    if not groups:
        raise ValueError("model has no trainable parameters")
    present = {g["module"] for g in groups}
    for module, value in (module_lrs or {}).items():
        if value is not None and module not in present:
            why = {"encoder": " (model.freeze_encoder)", "llm": " (model.freeze_llm without model.lora)"}
            raise ConfigError(f"train.lr_{module}: set to {value}, but no {module} parameter is trainable"
                              + why.get(module, ""))
    params = [p for g in groups for p in g["params"]]
    # one fused kernel updates every tensor (CUDA: instead of several launches per group; CPU:
    # instead of a Python loop over tensors); sharded (DTensor) parameters keep the default
    fused = all(p.device.type in ("cuda", "cpu") and p.dtype == torch.float32 and not hasattr(p, "placements")
                for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused or None)


def optimizer_from_config(model: nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    """The run's optimizer: train.lr, the per-module lrs, weight decay, betas, eps."""
    lrs = {"encoder": train.lr_encoder, "projector": train.lr_projector, "llm": train.lr_llm}
    return build_optimizer(model, train.lr, train.weight_decay, train.betas, train.eps, lrs)


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


def held_then(hold: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """Exactly 0 for the first ``hold`` steps, then :func:`warmup_cosine` started at ``hold``
    and ending at ``total_steps`` (the groups that wait out the projector-only warm-up)."""
    rest = warmup_cosine(warmup_steps, total_steps - hold if total_steps > 0 else 0, min_ratio)
    return lambda step: 0.0 if step < hold else rest(step - hold)


class ModuleLR(LambdaLR):
    """LambdaLR whose state names the module of each group, so a checkpoint of another group
    layout (another freezing, an older west) fails to resume with a message instead of
    silently scheduling only some groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, lambdas: list[Callable[[int], float]]) -> None:
        self.modules = [g.get("module", "other") for g in optimizer.param_groups]
        super().__init__(optimizer, lambdas)

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("modules") or ["?"] * len(state_dict.get("base_lrs", []))
        if len(saved) != len(self.modules) or "?" not in saved and list(saved) != self.modules:
            raise CheckpointError(f"the checkpoint's optimizer groups ({', '.join(saved)}) differ from this run's "
                                  f"({', '.join(self.modules)}): it was written with other frozen/trainable "
                                  "modules (model.freeze_*, model.lora) or by an older west")
        super().load_state_dict(state_dict)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    min_ratio: float = 0.0, projector_warmup_steps: int = 0) -> ModuleLR:
    """One lambda per param group (a LambdaLR over closures: its state_dict holds only counters,
    so a resumed run may change max_steps and the schedule follows the new value).

    With ``projector_warmup_steps`` W > 0 the projector side follows warmup + cosine from step 0;
    every other group is held at lr 0 for W steps: AdamW then moves none of its parameters
    (update and decoupled decay both scale with lr), though their moments see the gradients."""
    hold = projector_warmup_steps
    modules = [g.get("module", "other") for g in optimizer.param_groups]
    if hold > 0:
        if "projector" not in modules:
            raise ConfigError("train.projector_warmup_steps: no trainable projector parameter to warm up")
        if 0 < total_steps <= hold:
            raise ConfigError(f"train.projector_warmup_steps: {hold} >= the run's {total_steps} steps "
                              "(nothing but the projector would ever train)")
    plain = warmup_cosine(warmup_steps, total_steps, min_ratio)
    held = held_then(hold, warmup_steps, total_steps, min_ratio) if hold > 0 else plain
    return ModuleLR(optimizer, [plain if m == "projector" else held for m in modules])


def scheduler_from_config(optimizer: torch.optim.Optimizer, train: TrainConfig, total_steps: int) -> ModuleLR:
    """The run's schedule: warmup + cosine per group, the projector-only warm-up first."""
    return build_scheduler(optimizer, train.warmup_steps, total_steps, train.min_lr_ratio,
                           train.projector_warmup_steps)


def describe_groups(model: nn.Module, optimizer: torch.optim.Optimizer, projector_warmup_steps: int = 0) -> str:
    """One line: trainable parameters and peak lr per module (the LLM marked LoRA when only
    adapters train), and the projector-only warm-up if any."""
    lora = any(p.requires_grad and "lora_" in n for n, p in model.named_parameters())
    sizes: dict[str, list] = {}
    for g in optimizer.param_groups:
        n, lr = sizes.get(g.get("module", "other"), [0, g.get("initial_lr", g["lr"])])
        sizes[g.get("module", "other")] = [n + sum(p.numel() for p in g["params"]), lr]
    parts = [f"{'llm (LoRA)' if m == 'llm' and lora else m} "
             f"{f'{n / 1e6:.2f} M' if n >= 10_000 else f'{n:,}'} at lr {lr:.3g}"
             for m, (n, lr) in sizes.items()]
    warm = f"; projector-only warm-up: first {projector_warmup_steps} steps" if projector_warmup_steps else ""
    return "trainable: " + ", ".join(parts) + warm
