"""What of the model a training checkpoint stores, and the checks that make it safe to load.

A lean checkpoint (the default, ``train.save_frozen_llm: false``) leaves out the frozen
parameters of the base LLM: they are the files under ``model.llm.path``, recorded in meta.json
by path and fingerprint (west.models.llm.llm_fingerprint) and re-read from there on resume,
decode and export. LoRA adapters go to ``CKPT/adapter/`` in peft's own format; everything
else trainable (encoder, projector, CTC head, unfrozen LLM parameters) and every buffer go to
``model.safetensors``. Loading checks, before any weight moves: the same LoRA settings, the
same base LLM bytes, and that the files hold exactly the model's entries less the referenced
ones. Checkpoints written before (everything in model.safetensors) load as they are.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from west.checkpoint.base_llm import BaseLLM, LeanError, check_base, frozen_names
from west.checkpoint.files import load_tensors
from west.models.llm import ADAPTER_CONFIG, adapter_key_map, is_peft, load_adapter, read_adapter_settings, save_adapter
from west.ranks import get_rank, unwrap

ADAPTER_DIR = "adapter"


def peft_part(model: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """(``"llm."``, the peft model) when the model holds a peft-wrapped submodule."""
    for name, sub in unwrap(model).named_modules():
        if name and is_peft(sub):
            return name + ".", sub
    return None


def lora_settings(model: nn.Module) -> Optional[dict]:
    """{r, alpha, target_modules} of the model's LoRA (as read_adapter_settings gives them)."""
    part = peft_part(model)
    if part is None:
        return None
    conf = part[1].peft_config["default"]
    return {"r": conf.r, "alpha": conf.lora_alpha, "target_modules": sorted(conf.target_modules)}


# ----------------------------------------------------------------------------- save

def gather_lean_state(model: nn.Module, skip: set[str]) -> dict[str, torch.Tensor]:
    """Collective: the full (unsharded, CPU) state on rank 0 without the ``skip`` entries,
    which are never gathered (under FSDP the frozen LLM stays sharded); {} on other ranks."""
    from torch.distributed.tensor import DTensor  # heavy

    rank, out = get_rank(), {}
    for name, t in unwrap(model).state_dict().items():
        if name in skip:
            continue
        if isinstance(t, DTensor):
            t = t.full_tensor()  # every rank, same order
        if rank == 0:
            out[name] = t.detach().cpu()
    return out


def split_adapter(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[dict, Optional[tuple]]:
    """(the entries for model.safetensors, (peft model, its adapter entries) or None)."""
    part = peft_part(model)
    if part is None:
        return state, None
    prefix, peft_model = part
    under = [n[len(prefix):] for n in state if n.startswith(prefix)]
    adapter = set(adapter_key_map(peft_model, under))
    tensors = {n: state[prefix + n] for n in under if n in adapter}
    rest = {n: t for n, t in state.items() if not (n.startswith(prefix) and n[len(prefix):] in adapter)}
    return rest, (peft_model, tensors)


def write_adapter(adapter: tuple, out_dir: Path) -> list[Path]:
    peft_model, tensors = adapter
    return save_adapter(peft_model, tensors, out_dir)


# ----------------------------------------------------------------------------- load

def describe_lora(s: Optional[dict]) -> str:
    if not s:
        return "no LoRA"
    return f"LoRA r={s['r']}, alpha={s['alpha']}, target_modules={list(s['target_modules'])}"


def check_lora(ckpt: Path, meta: dict, model: nn.Module) -> None:
    """Resuming needs the LoRA the checkpoint was trained with: same rank, alpha and targets."""
    saved = read_adapter_settings(ckpt / ADAPTER_DIR) or meta.get("lora")
    now = lora_settings(model)
    if saved is None and now is None:
        return
    if saved is None:
        if (ckpt / ADAPTER_DIR).exists() or "model_state" not in meta:
            return  # written before adapters had their own dir: the key check decides
        raise LeanError(f"{ckpt} was trained without LoRA, this run sets model.lora ({describe_lora(now)}): "
                        "drop model.lora to resume it, or start a new run.output_dir")
    if now is None:
        raise LeanError(f"{ckpt} was trained with {describe_lora(saved)}, this run has no model.lora: its "
                        f"adapters would be dropped; resume with --model.lora \"{{r: {saved['r']}, alpha: "
                        f"{saved['alpha']}, target_modules: [{', '.join(saved['target_modules'])}]}}\"")
    diff = [k for k in ("r", "alpha", "target_modules") if saved[k] != now[k]]
    if diff:
        why = {"r": "the adapter matrices and their optimizer state have another shape",
               "alpha": "the adapters would be scaled differently from how they were trained",
               "target_modules": "other layers carry adapters"}
        raise LeanError(f"{ckpt} was trained with {describe_lora(saved)}, this run has {describe_lora(now)}: "
                        + "; ".join(f"model.lora.{'target_modules' if k == 'target_modules' else k} differs "
                                    f"({why[k]})" for k in diff))


def read_model_state(ckpt: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """model.safetensors plus the adapter dir (names of the model's state dict)."""
    state = load_tensors(ckpt / "model.safetensors")
    adapter = ckpt / ADAPTER_DIR
    if (adapter / ADAPTER_CONFIG).is_file():
        part = peft_part(model)
        if part is None:
            raise LeanError(f"{adapter}: LoRA adapters, but the model has no model.lora")
        prefix, peft_model = part
        state.update({prefix + n: t for n, t in load_adapter(peft_model, adapter).items()})
    return state


def check_keys(ckpt: Path, meta: dict, model: nn.Module, state: dict) -> None:
    """The files must hold exactly the model's entries, less the referenced base LLM's."""
    expected = set(unwrap(model).state_dict())
    ref = meta.get("base_llm")
    allowed = frozen_names(model, ref.get("prefix", "llm.")) if ref else set()
    missing = sorted(expected - set(state) - allowed)
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise LeanError(f"{ckpt}: does not fit this model: missing {missing[:5]}"
                        f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                        f"{' ...' if len(unexpected) > 5 else ''} (another model config than the run's?)")


def load_model_weights(ckpt: Path, meta: dict, model: nn.Module, base: Optional[BaseLLM]) -> dict:
    """Checks (LoRA, base LLM, entries), then the state to load, for a model on one process
    (decode, export); the trainer goes through checkpoint.load_checkpoint."""
    check_lora(ckpt, meta, model)
    check_base(ckpt, meta, base)
    state = read_model_state(ckpt, model)
    check_keys(ckpt, meta, model, state)
    return state


def state_bytes(model: nn.Module, skip: set[str]) -> int:
    """Bytes of the model's state without ``skip`` (tied tensors once): model.safetensors + adapters."""
    seen, total = set(), 0
    for name, t in unwrap(model).state_dict(keep_vars=True).items():  # tied: the same Parameter
        if name in skip or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total
