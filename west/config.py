"""A run's one config tree (run/train/data/model, keys: docs/config.md): ``load_config`` reads YAML,
applies ``--section.key VALUE`` overrides and validates; every error is a ConfigError naming the key."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import field
from pathlib import Path
from typing import Collection, Sequence

import yaml

from west.data.config import DataConfig, for_shape
from west.models.config import SpeechLLMConfig
from west.schema import ConfigError, require, section
from west.train.config import RunConfig, TrainConfig

# attention that runs on CUDA only (west_varlen's backends, and the stock flash_attention_*), and why
CUDA_ONLY = {"flash": "needs a CUDA device", "torch_varlen": "is torch's CUDA kernel",
             "flex": "cannot train on CPU (FlexAttention has no CPU backward)"}


@section("")
class Config:
    """The whole config of a run; ``to_dict()`` is what DIR/config.yaml holds."""

    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: SpeechLLMConfig = field(default_factory=SpeechLLMConfig)


def set_override(raw: dict, dotted: str, value: str) -> None:
    """``--model.encoder.d_model 128`` -> raw["model"]["encoder"]["d_model"] = "128" (typed when built)."""
    parts, node = dotted.split("."), raw
    for part in parts[:-1]:
        child = node.get(part)
        child = yaml.safe_load(child) if isinstance(child, str) else child  # a block given whole before
        node[part] = node = child if isinstance(child, dict) else {}
    node[parts[-1]] = value


def split_weighted_lists(raw: dict) -> None:
    """``run.train_data: [{path, weight}, ...]`` -> the paths, and the weights into ``data.weights``."""
    run, data = raw.get("run"), raw.setdefault("data", {})
    lists = run.get("train_data") if isinstance(run, dict) and isinstance(data, dict) else None
    lists = yaml.safe_load(lists) if isinstance(lists, str) and lists.strip().startswith("[") else lists
    if isinstance(lists, list) and any(isinstance(x, dict) for x in lists):
        require(all(isinstance(x, dict) and set(x) == {"path", "weight"} for x in lists), "run.train_data",
                f"give all lists as paths or all as {{path, weight}} mappings, got {lists!r}")
        require(data.get("weights") is None, "data.weights", "given twice: here and in run.train_data's weights")
        run["train_data"], data["weights"] = [x["path"] for x in lists], [x["weight"] for x in lists]


def merge(yaml_path: str | None = None, overrides: Sequence[tuple[str, str]] = ()) -> dict:
    """The YAML file's sections with the overrides applied, untyped (``Config.from_dict`` types and checks it)."""
    raw = {}
    if yaml_path:
        require(os.path.isfile(yaml_path), "--config", f"no such file: {yaml_path}")
        try:
            raw = yaml.safe_load(Path(yaml_path).read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config: {yaml_path} is not valid YAML: {e}") from None
        require(isinstance(raw, dict), "--config", f"{yaml_path}: the top level must be a mapping of sections")
        raw = {name: sec or {} for name, sec in raw.items()}
    for dotted, value in overrides:
        set_override(raw, dotted, value)
    split_weighted_lists(raw)
    return raw


def load_config(yaml_path: str | None = None, overrides: Sequence[tuple[str, str]] = ()) -> Config:
    """YAML file + ordered ``(section.key, value)`` overrides -> typed, validated Config."""
    cfg = Config.from_dict(merge(yaml_path, overrides))
    validate(cfg, {dotted for dotted, _ in overrides})
    return cfg


def validate(cfg: Config, explicit: Collection[str] = ()) -> None:
    """The checks across sections or outside the config (a pretrained encoder's dir config is read here,
    before any data is); ``explicit``: the dotted keys set on the command line."""
    from west.data.policies import POLICIES  # the data side says which key sizes each batch mode
    from west.models.encoders import encoder_class  # heavy
    from west.ranks import resolved_device  # heavy

    data, run, model, llm = cfg.data, cfg.run, cfg.model, cfg.model.llm
    used = POLICIES[data.batch_type].size_key
    for key in sorted({p.size_key for p in POLICIES.values()} - {used}):
        require(f"data.{key}" not in explicit, f"data.{key}",
                f"not used with data.batch_type={data.batch_type} (that mode is sized by data.{used})")
    require(data.weights is None or not run.train_data or len(data.weights) == len(run.train_data),
            "data.weights", f"{len(data.weights or [])} weights for {len(run.train_data)} lists in run.train_data")
    require(llm.path, "model.llm.path", "required: the directory the tokenizer and the LLM are loaded from")
    require(os.path.isdir(llm.path), "model.llm.path", f"no such directory: {llm.path}")
    require(os.path.isfile(os.path.join(llm.path, "config.json")), "model.llm.path",
            f"{llm.path} is not a Hugging Face model directory (no config.json)")
    # attention: a CUDA-only kernel on CPU fails with the override that runs there (no silent fallback)
    key = "model.llm." + ("attn_backend" if llm.attn_implementation == "west_varlen" else "attn_implementation")
    name = llm.attn_backend if key.endswith("backend") else llm.attn_implementation
    kind = "flash" if name.startswith("flash") else name if key.endswith("backend") else None
    require(resolved_device(cfg.train.device) == "cuda" or kind not in CUDA_ONLY, key, f"{name} {CUDA_ONLY.get(kind)}, "
            f"but train.device={cfg.train.device} resolves to cpu; on CPU use --model.llm.attn_implementation "
            "west_varlen --model.llm.attn_backend auto (per-sample SDPA, exact)")
    require(kind != "flash" or importlib.util.find_spec("flash_attn"), key,
            f"{name} needs the flash-attn package: pip install -e '.[gpu]' in west's checkout")
    from west.train.encoder_graphs import check_encoder_graphs  # heavy (torch)

    check_encoder_graphs(cfg)
    _check_shared_prefix(cfg)
    enc, shape = model.encoder, model.speech_shape()
    require(enc.init is None or os.path.isfile(enc.init), "model.encoder.init", f"no such file: {enc.init}")
    require("data.num_mel_bins" not in explicit or data.num_mel_bins == shape.num_mel_bins, "data.num_mel_bins",
            f"{data.num_mel_bins} != {shape.num_mel_bins}, the feature width the encoder reads (leave it out: it "
            "follows model.encoder.input_dim, or a pretrained encoder's mel bins)")
    cfg.data = for_shape(data, shape)
    layers = encoder_class(enc.type).num_layers(enc)
    require(model.freeze_encoder_blocks <= layers, "model.freeze_encoder_blocks",
            f"must be <= the encoder's {layers} layers, got {model.freeze_encoder_blocks}")


def split_overrides(rest: Sequence[str]) -> list[tuple[str, str]]:
    """``--section.key VALUE`` / ``--section.key=VALUE`` pairs -> [(dotted, value)], in order."""
    out, tokens = [], iter(rest)
    for tok in tokens:
        require(tok.startswith("--"), repr(tok), "unexpected argument (overrides are --section.key VALUE)")
        dotted, eq, value = tok[2:].partition("=")
        value = value if eq else next(tokens, None)
        require(value is not None, tok, "missing value")
        require("." in dotted, f"--{dotted}", "unknown option")
        out.append((dotted, value))
    return out


def _check_shared_prefix(cfg: Config) -> None:
    """data.shared_prefix gives each sample keys of its own (the row's prefix, then its tokens): only
    west's attention takes them, through a kernel that aligns a causal mask bottom-right."""
    if not cfg.data.shared_prefix:
        return
    llm = cfg.model.llm
    require(llm.attn_implementation == "west_varlen", "data.shared_prefix",
            f"needs model.llm.attn_implementation west_varlen, got {llm.attn_implementation}")
    require(llm.attn_backend != "flex", "data.shared_prefix",
            "not with model.llm.attn_backend flex (use auto, sdpa_segments, torch_varlen or flash)")
    require(not cfg.train.compile, "data.shared_prefix", "not with train.compile (the LLM's compiled layers)")
