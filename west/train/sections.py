"""The ``data`` and ``model`` sections of a training config and the checks across sections.

west/data and west/models must not import west/train, so the trainer registers
their dataclasses (``DataConfig``, ``SpeechLLMConfig``) as section schemas here
and adds the cross-section validators. All of it runs inside ``build_config``,
i.e. before any data is read, and every error names the key to change.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import fields

from west.data.config import DataConfig
from west.models.config import SpeechLLMConfig
from west.train import config as train_config
from west.train.config import Config, ConfigError, register_section, register_validator, require

LLM_DTYPES = ("float32", "bfloat16", "float16")
# DataConfig keys that are facts about the model, copied from the model section.
GEOMETRY = {"subsampling_rate": ("encoder", "subsampling_rate"),
            "projector_stride": ("projector", "stride")}


def register() -> None:
    """Give ``data``/``model`` their schemas and add the validators (idempotent)."""
    register_section("data", DataConfig)
    register_section("model", SpeechLLMConfig)
    for fn in (sync_geometry, check_train_data, check_llm, check_attention_device):
        if fn not in train_config.VALIDATORS:
            register_validator(fn)


def sync_geometry(cfg: Config) -> None:
    """data.subsampling_rate / data.projector_stride follow the model; a conflicting value is an error."""
    defaults = {f.name: f.default for f in fields(DataConfig)}
    for key, (part, attr) in GEOMETRY.items():
        model_value = getattr(getattr(cfg.model, part), attr)
        given = getattr(cfg.data, key)
        set_by_user = f"data.{key}" in cfg.explicit or given != defaults[key]
        if set_by_user and given != model_value:
            raise ConfigError(f"data.{key}={given} contradicts model.{part}.{attr}={model_value}: it is "
                              f"derived from the model, leave data.{key} out")
        setattr(cfg.data, key, model_value)


def check_train_data(cfg: Config) -> None:
    require("," not in cfg.run.train_data, "run.train_data",
            "one data list per run (concatenate jsonl lists, or list all shards in one shard list)")


def check_llm(cfg: Config) -> None:
    """The tokenizer and the LLM come from ``model.llm.path``: it must be a HF model dir."""
    from west.models.attention import BACKENDS

    llm = cfg.model.llm
    require(bool(llm.path), "model.llm.path",
            "required: the tokenizer and the LLM are loaded from this directory (--model.llm.path DIR)")
    require(os.path.isdir(llm.path), "model.llm.path", f"no such directory: {llm.path}")
    require(os.path.isfile(os.path.join(llm.path, "config.json")), "model.llm.path",
            f"{llm.path} is not a Hugging Face model directory (no config.json)")
    require(llm.dtype in LLM_DTYPES, "model.llm.dtype", f"must be one of {LLM_DTYPES}, got {llm.dtype!r}")
    require(llm.attn_backend in BACKENDS, "model.llm.attn_backend",
            f"must be one of {BACKENDS}, got {llm.attn_backend!r}")


def resolved_device(cfg: Config) -> str:
    """What ``train.device`` will be: cpu or cuda (auto picks CUDA when available)."""
    from west.train.distributed import pick_device

    try:
        return pick_device(cfg.train.device).type
    except RuntimeError as e:  # cuda requested without CUDA
        raise ConfigError(str(e)) from None  # names train.device


def check_attention_device(cfg: Config) -> None:
    """flash-attn needs CUDA and the flash-attn package; FlexAttention cannot train on CPU.

    No silent fallback: a config written for GPUs fails on a CPU machine with the
    override that makes it run there."""
    device = resolved_device(cfg)
    llm = cfg.model.llm
    impl, backend = llm.attn_implementation, llm.attn_backend
    if impl.startswith("flash_attention"):
        key, what = "model.llm.attn_implementation", impl
    elif impl == "west_varlen" and backend == "flash":
        key, what = "model.llm.attn_backend", "flash"
    else:
        key = what = None
    if key is not None:
        require(device == "cuda", key,
                f"{what} needs a CUDA device, but train.device={cfg.train.device} resolves to cpu; "
                "on CPU use --model.llm.attn_implementation west_varlen --model.llm.attn_backend auto "
                "(per-sample SDPA, exact)")
        require(importlib.util.find_spec("flash_attn") is not None, key,
                f"{what} needs the flash-attn package: pip install 'west[gpu]'")
    if impl == "west_varlen" and backend == "flex":
        require(device == "cuda", "model.llm.attn_backend",
                "flex cannot train on CPU (FlexAttention has no CPU backward); use auto")
