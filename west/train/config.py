"""Training configuration: YAML sections + typed command-line overrides.

A config is a mapping of sections (``run``, ``train``, ``data``, ``model``,
``decode``). Sections with a registered dataclass schema are validated key by
key; the others stay plain dicts until their owners register a schema with
:func:`register_section` (the CLI does that, so west/data and west/models need
not import west/train). Everything is checked before any data is read, and
every error names the offending key. The command line lives in west.train.cli.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import yaml


class ConfigError(ValueError):
    """A config problem found before training starts; the message names the key."""


@dataclass
class RunConfig:
    """Where a run reads from and writes to (filled from top-level CLI flags)."""

    output_dir: str = ""
    train_data: str = ""
    resume: str = "auto"  # auto | never | must | PATH of a checkpoint dir
    audit: bool = False


@dataclass
class TrainConfig:
    """The optimisation schedule and engine switches of one run."""

    seed: int = 42
    lr: float = 1e-4
    min_lr_ratio: float = 0.0          # cosine floor as a fraction of lr
    warmup_steps: int = 100
    max_steps: int = 0                 # 0 = no step limit (max_epochs decides)
    max_epochs: int = 1                # 0 = no epoch limit (max_steps decides)
    accum_steps: int = 1               # micro-batches per optimizer step (per rank)
    grad_clip: float = 1.0             # max global grad norm; 0 = off (norm still logged)
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    precision: str = "fp32"            # fp32 | bf16 (autocast; master weights stay fp32)
    grad_checkpointing: bool = False
    fsdp: bool = False                 # FSDP2 fully_shard instead of DDP
    find_unused_parameters: bool = False
    device: str = "auto"               # auto | cpu | cuda
    dist_timeout_s: int = 1800         # no collective waits longer than this
    max_bad_steps: int = 10            # NaN/inf steps in a row before stopping
    log_every: int = 10                # console/TensorBoard period (jsonl: every step)
    save_every: int = 1000             # steps between checkpoints; 0 = epoch ends only
    save_at_epoch_end: bool = True
    keep_last: int = 3
    tensorboard: bool = True
    progress_bar: bool = True
    nvml: bool = True                  # GPU busy %/memory sampler on CUDA
    monitor_interval_s: float = 0.2
    profile: bool = False              # torch.profiler trace to DIR/profile
    profile_wait: int = 5
    profile_active: int = 5


# Section name -> dataclass schema, or None for "free-form dict for now".
SECTIONS: dict[str, Optional[type]] = {
    "run": RunConfig,
    "train": TrainConfig,
    "data": None,
    "model": None,
    "decode": None,
}
# Cross-section checks added by other packages (e.g. "flash_attn needs CUDA").
VALIDATORS: list[Callable[["Config"], None]] = []

# Defaults for the data keys the CLI knows, used while `data` has no schema.
DATA_DEFAULTS = {"batch_type": "static", "batch_size": 32, "max_tokens_in_batch": 4096,
                 "pack_tokens": 8192}
BATCH_TYPE_KEY = {"static": "batch_size", "dynamic": "max_tokens_in_batch", "pack": "pack_tokens"}


def register_section(name: str, schema: Optional[type]) -> None:
    """Give section ``name`` a dataclass schema (or a free-form dict if None)."""
    if schema is not None and not dataclasses.is_dataclass(schema):
        raise TypeError(f"schema for section {name!r} must be a dataclass")
    SECTIONS[name] = schema


def register_validator(fn: Callable[["Config"], None]) -> None:
    """Add a cross-section check; it raises ConfigError naming the key."""
    VALIDATORS.append(fn)


class Config:
    """Resolved sections; ``cfg.train`` is a TrainConfig, ``cfg.data`` a dict or dataclass."""

    def __init__(self, sections: dict[str, Any], explicit: set[str] | None = None):
        self.sections = sections
        self.explicit = explicit or set()  # "section.key" set on the command line

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("sections", {})
        if name in sections:
            return sections[name]
        raise AttributeError(name)

    def get(self, dotted: str, default: Any = None) -> Any:
        """``cfg.get("model.llm.path")``: walks nested dataclasses and dicts."""
        node: Any = self.sections
        for part in dotted.split("."):
            if node is None:
                return default
            if isinstance(node, dict):
                if part not in node:
                    return default
                node = node[part]
            elif hasattr(node, part):
                node = getattr(node, part)
            else:
                return default
        return node

    def to_dict(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(sec) if dataclasses.is_dataclass(sec) else dict(sec)
                for name, sec in self.sections.items()}


# ----------------------------------------------------------------------------- typing

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Convert ``value`` (a CLI string or a YAML scalar) to ``typ`` or raise naming ``key``."""
    origin = typing.get_origin(typ)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, args[0] if len(args) == 1 else Any, key)
    if typ is Any or typ is None:
        return yaml.safe_load(value) if isinstance(value, str) else value
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in _TRUE:
                return True
            if str(value).lower() in _FALSE:
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
        if typ in (list, tuple) or origin in (list, tuple):
            if isinstance(value, str):
                value = yaml.safe_load(value) if value.strip().startswith("[") else \
                    [yaml.safe_load(v) for v in value.split(",")]
            if not isinstance(value, (list, tuple)):
                raise ValueError
            return list(value)
        if typ is dict or origin is dict:
            value = yaml.safe_load(value) if isinstance(value, str) else value
            if not isinstance(value, dict):
                raise ValueError
            return value
    except (ValueError, TypeError, yaml.YAMLError):
        raise ConfigError(f"{key}: cannot read {value!r} as {getattr(typ, '__name__', typ)}") from None
    return value


def _field_types(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(schema)}


def _dataclass_of(typ: Any) -> Optional[type]:
    """The dataclass behind a field type (also ``Optional[SomeDataclass]``), else None."""
    origin = typing.get_origin(typ)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        typ = args[0] if len(args) == 1 else None
    return typ if isinstance(typ, type) and dataclasses.is_dataclass(typ) else None


def _type_of_existing(value: Any) -> Any:
    return Any if value is None else type(value)


# ----------------------------------------------------------------------------- building

def _merge_yaml(path: str | None) -> dict[str, dict]:
    if not path:
        return {}
    if not os.path.isfile(path):
        raise ConfigError(f"--config: no such file: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: invalid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: top level must be a mapping of sections")
    for name, sec in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"{path}: unknown section {name!r} (known: {', '.join(SECTIONS)})")
        if sec is not None and not isinstance(sec, dict):
            raise ConfigError(f"{path}: section {name!r} must be a mapping")
    return {name: dict(sec or {}) for name, sec in raw.items()}


def _set_override(raw: dict[str, dict], dotted: str, value: str) -> None:
    """Apply ``--section.key value`` with the type of the schema field or existing value."""
    if "." not in dotted:
        raise ConfigError(f"--{dotted}: unknown option")
    section, key = dotted.split(".", 1)
    if section not in SECTIONS:
        raise ConfigError(f"--{dotted}: unknown section {section!r} (known: {', '.join(SECTIONS)})")
    schema = SECTIONS[section]
    sec = raw.setdefault(section, {})
    if schema is not None:
        _set_nested(sec, schema, key.split("."), value, section, dotted)
    else:
        existing = sec.get(key, DATA_DEFAULTS.get(key) if section == "data" else None)
        sec[key] = _coerce(value, _type_of_existing(existing), dotted)


def _build_section(name: str, values: dict, source: str) -> Any:
    schema = SECTIONS[name]
    if schema is None:
        if name == "data":
            return {**DATA_DEFAULTS, **values}
        return dict(values)
    return _build_dataclass(schema, values, name, source)


def _set_nested(node: dict, schema: type, parts: list[str], value: str, where: str, dotted: str) -> None:
    """``--model.encoder.d_model 128``: descend through dataclass-typed fields, type the leaf."""
    fields_ = _field_types(schema)
    key = parts[0]
    if key not in fields_:
        raise ConfigError(f"--{dotted}: unknown key {key!r} in {'section ' if '.' not in where else ''}{where!r}")
    sub = _dataclass_of(fields_[key])
    if len(parts) > 1:
        if sub is None:
            raise ConfigError(f"--{dotted}: {where}.{key} has no sub-keys")
        child = node.get(key)
        if not isinstance(child, dict):  # absent, or null (e.g. an optional block)
            child = node[key] = {}
        _set_nested(child, sub, parts[1:], value, f"{where}.{key}", dotted)
    elif sub is not None:  # a whole block given as YAML: --model.lora "{r: 8}" or none
        none = isinstance(value, str) and value.strip().lower() in ("none", "null", "~", "")
        parsed = None if none else yaml.safe_load(value) if isinstance(value, str) else value
        if parsed is not None and not isinstance(parsed, dict):
            raise ConfigError(f"--{dotted}: expected a mapping of {sub.__name__} keys or none")
        node[key] = parsed
    else:
        node[key] = _coerce(value, fields_[key], dotted)


def _build_dataclass(schema: type, values: dict, where: str, source: str) -> Any:
    """Typed instance of ``schema`` from a mapping; nested dataclass fields recurse."""
    fields_ = _field_types(schema)
    kwargs = {}
    for key, value in values.items():
        if key not in fields_:
            raise ConfigError(f"{source}: unknown key {where}.{key}")
        sub = _dataclass_of(fields_[key])
        if sub is not None and isinstance(value, dict):
            kwargs[key] = _build_dataclass(sub, value, f"{where}.{key}", source)
        elif sub is not None and not (value is None or isinstance(value, sub)):
            raise ConfigError(f"{where}.{key}: expected a mapping of {sub.__name__} keys, got {value!r}")
        else:
            kwargs[key] = _coerce(value, fields_[key], f"{where}.{key}")
    try:
        return schema(**kwargs)
    except (TypeError, ValueError) as e:  # a schema's own __post_init__ check
        raise ConfigError(f"section {where}: {e}") from None


def build_config(yaml_path: str | None = None, overrides: Sequence[tuple[str, str]] = (),
                 explicit: set[str] | None = None) -> Config:
    """YAML file + ordered ``(section.key, value)`` overrides -> validated Config."""
    raw = _merge_yaml(yaml_path)
    for dotted, value in overrides:
        _set_override(raw, dotted, value)
    sections = {name: _build_section(name, raw.get(name, {}), yaml_path or "config")
                for name in SECTIONS}
    cfg = Config(sections, explicit or {d for d, _ in overrides})
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- checks

def require(cond: bool, key: str, msg: str) -> None:
    """Raise ConfigError naming ``key`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def validate(cfg: Config) -> None:
    """Range and combination checks; the first problem raises ConfigError naming its key."""
    t: TrainConfig = cfg.train
    require(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    require(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
    require(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    require(t.max_steps >= 0, "train.max_steps", "must be >= 0")
    require(t.max_epochs >= 0, "train.max_epochs", "must be >= 0")
    require(t.max_steps > 0 or t.max_epochs > 0, "train.max_steps",
            "train.max_steps and train.max_epochs are both 0: the run would never end")
    require(t.accum_steps >= 1, "train.accum_steps", "must be >= 1")
    require(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 = off)")
    require(t.weight_decay >= 0, "train.weight_decay", "must be >= 0")
    require(len(t.betas) == 2 and all(0 <= float(b) < 1 for b in t.betas), "train.betas",
            f"must be two numbers in [0, 1), got {t.betas}")
    t.betas = [float(b) for b in t.betas]
    require(t.precision in ("fp32", "bf16"), "train.precision", f"must be fp32 or bf16, got {t.precision!r}")
    require(t.device in ("auto", "cpu", "cuda"), "train.device", f"must be auto, cpu or cuda, got {t.device!r}")
    require(t.dist_timeout_s > 0, "train.dist_timeout_s", "must be > 0")
    require(t.max_bad_steps >= 1, "train.max_bad_steps", "must be >= 1")
    require(t.log_every >= 1, "train.log_every", "must be >= 1")
    require(t.save_every >= 0, "train.save_every", "must be >= 0")
    require(t.keep_last >= 1, "train.keep_last", "must be >= 1")
    require(t.monitor_interval_s > 0, "train.monitor_interval_s", "must be > 0")
    require(t.profile_wait >= 0 and t.profile_active >= 1, "train.profile_active",
            "profile_wait must be >= 0 and profile_active >= 1")

    r: RunConfig = cfg.run
    require(r.resume in ("auto", "never", "must") or os.path.isdir(r.resume), "run.resume",
            f"must be auto, never, must or an existing checkpoint dir, got {r.resume!r}")

    btype = cfg.get("data.batch_type")
    require(btype in BATCH_TYPE_KEY, "data.batch_type", f"must be static, dynamic or pack, got {btype!r}")
    used = BATCH_TYPE_KEY[btype]
    for key in BATCH_TYPE_KEY.values():
        dotted = f"data.{key}"
        if key != used and dotted in cfg.explicit:
            raise ConfigError(f"{dotted}: not used with data.batch_type={btype} "
                              f"(that mode is sized by data.{used})")
    size = cfg.get(f"data.{used}")
    require(isinstance(size, int) and not isinstance(size, bool) and size > 0, f"data.{used}",
            f"must be a positive integer for batch_type {btype}, got {size!r}")
    for fn in VALIDATORS:
        fn(cfg)
