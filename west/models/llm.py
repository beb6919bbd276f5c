"""The causal LLM: a stock Hugging Face model loaded by path or config, optionally with LoRA.

Also what a checkpoint needs to refer to that LLM instead of storing it (a fingerprint of its
files) and to store LoRA adapters in peft's own format (``adapter_config.json`` +
``adapter_model.safetensors``, loadable by ``PeftModel.from_pretrained``)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from west.models.config import LLMConfig, LoraSettings
from west.models.encoders import RELEASE_TYPES, release_llm, release_of
from west.models.hf_attention import ATTN_NAME, register
from west.models.mlp_checkpoint import checkpoint_mlps
from west.models.precision import autocast_on
from west.schema import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Files whose bytes define a Hugging Face model: its config and its weights (tokenizer files
# do not change what the model computes and are left out).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_FINGERPRINTS: dict[tuple, dict] = {}


# a released speech LLM's checkpoint rows -> its language model's (AutoModelForCausalLM) rows
_RELEASE_LLM_KEYS = {r"^language_model\.": "", r"^model\.language_model\.": "model."}
# a processor's chat template (Qwen2-Audio's renders audio parts), kept beside the tokenizer's files
PROCESSOR_TEMPLATES = ("chat_template.jinja", "chat_template.json")


def load_tokenizer(path: str | Path):
    """The tokenizer of a model directory, with the chat template its processor uses when the
    directory has one (a released speech LLM: the model's own template, not the text LLM's)."""
    from transformers import AutoTokenizer  # heavy

    tok = AutoTokenizer.from_pretrained(str(path))
    for name in PROCESSOR_TEMPLATES:
        f = Path(path) / name
        if f.is_file():
            text = f.read_text(encoding="utf-8")
            tok.chat_template = json.loads(text)["chat_template"] if name.endswith(".json") else text
            break
    return tok


def load_llm(cfg: LLMConfig, hf_config=None) -> nn.Module:
    """Stock ``AutoModelForCausalLM``: from ``cfg.path`` (from_pretrained), else from a config."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy

    if cfg.attn_implementation == ATTN_NAME:
        register()
    kw = dict(attn_implementation=cfg.attn_implementation, dtype=getattr(torch, cfg.dtype))
    if hf_config is not None:
        release = release_of(getattr(hf_config, "model_type", None))
        if release is not None and release_llm(release) is not None:   # the release's own loader
            return release_llm(release)(None, hf_config, **kw)
        if getattr(hf_config, "model_type", None) in RELEASE_TYPES:
            hf_config = hf_config.get_text_config()
        return AutoModelForCausalLM.from_config(hf_config, **kw)
    if cfg.path:
        if not Path(cfg.path).is_dir():
            raise FileNotFoundError(f"model.llm.path {cfg.path!r} is not a directory")
        conf = AutoConfig.from_pretrained(cfg.path)
        release = release_of(conf.model_type)
        if release is not None and release_llm(release) is not None:
            return release_llm(release)(cfg.path, None, **kw)
        if hasattr(conf, "text_config") and conf.model_type in RELEASE_TYPES:
            # a released speech LLM's directory (west.models.encoders): its language model, rows under
            # language_model.* (Qwen2-Audio) or model.language_model.* (Qwen3-ASR)
            from transformers.utils import logging as hf_logging  # heavy

            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()   # the audio tower's rows are "unexpected" by design
            try:
                return AutoModelForCausalLM.from_pretrained(cfg.path, config=conf.get_text_config(),
                                                            key_mapping=_RELEASE_LLM_KEYS, **kw)
            finally:
                hf_logging.set_verbosity(level)
        return AutoModelForCausalLM.from_pretrained(cfg.path, **kw)
    if cfg.config:
        conf = dict(cfg.config)
        model_type = conf.pop("model_type", None)
        if model_type is None:
            raise ValueError("model.llm.config needs a 'model_type' (e.g. qwen2)")
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **conf), **kw)
    raise ValueError("model.llm needs either 'path' (local HF dir) or 'config' (HF config dict)")


# ----------------------------------------------------------------------------- LoRA

def lora_candidates(llm: nn.Module) -> list[str]:
    """Last name components of the LLM's Linear/Embedding/Conv1D modules: what LoRA can target."""
    names = set()
    for name, module in llm.named_modules():
        if name and (isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ == "Conv1D"):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def check_lora_targets(llm: nn.Module, targets: list[str]) -> None:
    """Every entry of ``model.lora.target_modules`` must name a module of the LLM (peft matches
    a name or a dotted suffix; peft itself only objects when none matches)."""
    names = [n for n, _ in llm.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ConfigError(f"model.lora.target_modules: {', '.join(map(repr, missing))} matches no module of the "
                         f"LLM ({type(llm).__name__}); candidates: {', '.join(lora_candidates(llm))}")


def apply_lora(llm: nn.Module, lora: LoraSettings) -> nn.Module:
    """peft's LoRA around ``llm`` (its base weights frozen by peft), after checking the targets."""
    try:
        from peft import LoraConfig, get_peft_model  # heavy
    except ImportError as e:  # optional extra
        raise ImportError("model.lora needs peft: pip install -e '.[lora]' in west's checkout") from e
    check_lora_targets(llm, list(lora.target_modules))
    conf = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(llm, conf)


class LoraInputCasts:
    """peft (0.15 on) casts each adapted projection's input to the adapters' dtype before their
    products (``cast_input_dtype_enabled``). With float32 adapters under bf16 autocast that makes a
    float32 copy of every adapted input, runs the adapter's dropout on it, and autocast casts it back
    to bf16 for the product: two copies of the activation per adapter and pass, and their
    gradients', for the same bf16 product (a bf16 value survives the float32 round trip exactly).
    So the cast is off while autocast is on, and on elsewhere, where a bf16 input has to meet float32
    adapters in float32. The dropout then runs on the bf16 input: with dropout 0 the step is the same
    bit for bit (tests/test_models_lora_casts.py); with dropout the masks are other draws."""

    def __init__(self, llm: nn.Module) -> None:
        self.layers = [m for m in llm.modules() if hasattr(m, "cast_input_dtype_enabled")]
        self.enabled = True

    def match(self, device_type: str) -> None:
        """The casts off if autocast is on for ``device_type``, else on (the flags set only when that changes)."""
        enabled = not autocast_on(device_type)
        if enabled != self.enabled:
            for layer in self.layers:
                layer.cast_input_dtype_enabled = enabled
            self.enabled = enabled


def is_peft(module: nn.Module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def adapter_key_map(peft_model: nn.Module, names: list[str]) -> dict[str, str]:
    """{state-dict name under the peft model: its key in peft's saved format} for the adapter
    entries among ``names``; peft's own renaming (drops the adapter name), no tensor is read."""
    from peft import get_peft_model_state_dict  # heavy

    index = {n: torch.tensor(i) for i, n in enumerate(names)}
    saved = get_peft_model_state_dict(peft_model, state_dict=index, save_embedding_layers=False)
    return {names[int(v)]: k for k, v in saved.items()}


def save_adapter(peft_model: nn.Module, tensors: dict[str, torch.Tensor], out_dir: Path) -> list[Path]:
    """Write ``tensors`` (state-dict names under the peft model, all its adapter entries) as a
    peft adapter dir; returns the files written (for the caller's fsync)."""
    from safetensors.torch import save_file  # heavy

    out_dir.mkdir(parents=True, exist_ok=True)
    keys = adapter_key_map(peft_model, list(tensors))
    save_file({keys[n]: t.contiguous() for n, t in tensors.items() if n in keys}, str(out_dir / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    peft_model.peft_config["default"].save_pretrained(str(out_dir))
    return [out_dir / ADAPTER_WEIGHTS, out_dir / ADAPTER_CONFIG]


def load_adapter(peft_model: nn.Module, adapter_dir: Path) -> dict[str, torch.Tensor]:
    """A peft adapter dir as state-dict names under ``peft_model`` (the inverse of save_adapter).
    An adapter entry the model does not have is an error naming it."""
    from safetensors.torch import load_file  # heavy

    saved = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    back = {v: k for k, v in adapter_key_map(peft_model, list(peft_model.state_dict())).items()}
    unknown = sorted(set(saved) - set(back))
    if unknown:
        raise ValueError(f"{adapter_dir / ADAPTER_WEIGHTS}: adapter entries this model's LoRA does not have: "
                         f"{unknown[:5]} (model.lora.target_modules differs from the run that saved it?)")
    return {back[k]: t for k, t in saved.items()}


def read_adapter_settings(adapter_dir: Path) -> Optional[dict]:
    """{r, alpha, target_modules} of a saved adapter (None if ``adapter_dir`` has none)."""
    path = adapter_dir / ADAPTER_CONFIG
    if not path.is_file():
        return None
    conf = json.loads(path.read_text(encoding="utf-8"))
    targets = conf.get("target_modules") or []
    return {"r": conf.get("r"), "alpha": conf.get("lora_alpha"),
            "target_modules": sorted(targets) if isinstance(targets, list) else targets}


# ----------------------------------------------------------------------------- fingerprint

def model_files(path: str | os.PathLike) -> list[Path]:
    """config.json and the weight files of a Hugging Face model dir, sorted by name."""
    root = Path(path)
    files = [p for p in root.iterdir() if p.is_file() and (p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES))]
    return sorted(files, key=lambda p: p.name)


def llm_fingerprint(path: str | os.PathLike) -> dict:
    """``{"sha256", "files", "bytes"}``: SHA-256 over (name, size, every byte) of each file of
    :func:`model_files`. Computed once per process for a path whose files' names, sizes and
    mtimes are unchanged (~600 MB/s on a 2-core CPU without SHA extensions: ~5 s for a 3 GB
    Qwen2-1.5B; several GB/s where the CPU has them)."""
    files = model_files(path)
    if not any(p.name == "config.json" for p in files):
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model dir)")
    key = (str(Path(path).resolve()), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if key not in _FINGERPRINTS:
        h = hashlib.sha256()
        for p in files:
            h.update(f"{p.name}\0{p.stat().st_size}\0".encode())
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        _FINGERPRINTS[key] = {"sha256": h.hexdigest(), "files": [p.name for p in files],
                              "bytes": sum(p.stat().st_size for p in files)}
    return dict(_FINGERPRINTS[key])


def hf_checkpointing(model: nn.Module, on: bool = True, layers: Optional[int] = None) -> None:
    """Per-layer activation checkpointing of a transformers model (non-reentrant), through the
    API the installed release names (``activation_checkpointing_*`` since 5.2x, else ``gradient_*``);
    ``layers``: only the first that many decoder layers (None: all)."""
    _hf_checkpointing(model, on)
    if on and layers is not None:
        from transformers.modeling_layers import GradientCheckpointingLayer  # heavy

        blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if layers > len(blocks):
            raise ValueError(f"model.llm.checkpoint_layers {layers} > the LLM's {len(blocks)} decoder layers")
        for i, block in enumerate(blocks):
            block.gradient_checkpointing = i < layers


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (``.model.layers``), in order."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layer list at .model.layers")
    return list(layers)


def llm_checkpointing(model: nn.Module, cfg: LLMConfig) -> None:
    """``model.llm.gradient_checkpointing`` as ``checkpoint_scope`` says: whole decoder layers
    replayed (``layer``), or only each frozen SwiGLU MLP's products recomputed (``mlp``,
    west.models.mlp_checkpoint); the first ``checkpoint_layers`` layers (None: all)."""
    if cfg.checkpoint_scope == "mlp":
        checkpoint_mlps(decoder_layers(model), cfg.checkpoint_layers)
    else:
        hf_checkpointing(model, layers=cfg.checkpoint_layers)


def _hf_checkpointing(model: nn.Module, on: bool) -> None:
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
