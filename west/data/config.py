"""Every option of the data pipeline in one validated dataclass.

The trainer builds a ``DataConfig`` from YAML/CLI, fills ``subsampling_rate``
and ``projector_stride`` from the model config (they decide how many LLM slots a
speech segment takes), and passes it to ``west.data.dataset.build_dataloader``.
Validation names the offending key so a typo fails before the first batch.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from dataclasses import dataclass, fields
from typing import Any, Optional

from west.data.packing import ALGORITHMS, COSTS
from west.shapes import SUBSAMPLING_LAYERS

BATCH_TYPES = ("static", "dynamic", "pack")
ENCODER_LAYOUTS = ("packed", "padded")
DATA_TYPES = ("auto", "raw", "shard", "kaldi")
PLAN_MODES = ("auto", "always", "never")
from west.shapes import SPEECH_MARKER  # noqa: F401  (re-exported)
# Options that change which samples form which batch (a resume must not change them).
_BATCHING_KEYS = ("batch_type", "batch_size", "max_tokens_in_batch", "pack_tokens", "pack_buffer",
                  "pack_algorithm", "pack_cost", "data_type", "plan", "shuffle", "shuffle_buffer",
                  "sort_buffer", "min_duration", "max_duration", "sample_rate", "frame_length_ms",
                  "frame_shift_ms", "prompt", "system_prompt", "subsampling_rate", "projector_stride")


@dataclass
class DataConfig:
    # batching
    batch_type: str = "static"          # static | dynamic | pack
    batch_size: int = 32                # static: samples per batch
    max_tokens_in_batch: int = 4096     # dynamic: longest * n_samples <= this (padded LLM tokens)
    pack_tokens: int = 8192             # pack: LLM tokens a row holds at most
    pack_pad_multiple: int = 8          # pack: width = longest row rounded up to this (0 = always pack_tokens)
    pack_buffer: int = 2000             # pack: samples handed to the packer at once
    pack_algorithm: str = "bfd"         # nf (streaming next-fit baseline) | ffd | bfd
    pack_cost: str = "linear"           # linear | square: what balances ranks' packs in a step
    encoder_layout: str = "packed"      # pack: encoder feats packed (ΣT,F) or padded (N,Tmax,F)
    # input and order
    data_type: str = "auto"             # auto | raw (jsonl) | shard (tar list) | kaldi (feats.scp)
    plan: str = "auto"                  # auto: plan the epoch when lengths are known; always | never
    shuffle: bool = True                # training only
    shuffle_buffer: int = 1500          # streamed data: sample shuffle buffer
    sort_buffer: int = 500              # dynamic: sort by length within windows of this size
    min_duration: float = 0.0           # seconds; 0 = no limit
    max_duration: float = 0.0           # seconds; 0 = no limit
    # features
    sample_rate: int = 16000
    num_mel_bins: int = 80
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    dither: float = 1.0                 # training only, on the int16 scale (Kaldi convention)
    cmvn: Optional[str] = None          # JSON from tools/compute_cmvn.py (or WeNet global_cmvn)
    spec_aug: bool = False              # training only
    spec_aug_num_t_mask: int = 2
    spec_aug_num_f_mask: int = 2
    spec_aug_max_t: int = 50
    spec_aug_max_f: int = 10
    # prompt
    prompt: str = SPEECH_MARKER + "Transcribe the speech."  # user turn; the marker is the speech
    system_prompt: Optional[str] = None
    # model geometry (set by the trainer from the model config)
    subsampling_rate: int = 4
    projector_stride: int = 2
    # loader
    num_workers: int = 0
    prefetch_factor: int = 2
    pin_memory: bool = False
    max_warnings: int = 20              # warnings per skip category per worker and epoch

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DataConfig":
        """Build from a mapping; an unknown key is an error that names it."""
        known = {f.name for f in fields(cls)}
        for k in d:
            if k not in known:
                raise ValueError(f"unknown data config key {k!r}; known keys: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "DataConfig":
        return dataclasses.replace(self, **changes)

    def fingerprint(self) -> str:
        """Hash of the options that decide which batches an epoch has (for resume checks)."""
        keep = {k: v for k, v in self.to_dict().items() if k in _BATCHING_KEYS}
        return hashlib.sha1(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]

    def validate(self) -> None:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"data config {key}={getattr(self, key)!r}: {why}")

        choices = {"batch_type": BATCH_TYPES, "encoder_layout": ENCODER_LAYOUTS,
                   "data_type": DATA_TYPES, "plan": PLAN_MODES,
                   "pack_algorithm": ALGORITHMS, "pack_cost": COSTS}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise bad(key, f"must be one of {allowed}")
        for key in ("batch_size", "max_tokens_in_batch", "pack_tokens", "pack_buffer",
                    "shuffle_buffer", "sort_buffer", "sample_rate", "num_mel_bins",
                    "projector_stride", "prefetch_factor"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(key, "must be an integer >= 1")
        for key in ("num_workers", "max_warnings", "pack_pad_multiple", "spec_aug_num_t_mask", "spec_aug_num_f_mask",
                    "spec_aug_max_t", "spec_aug_max_f"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(key, "must be an integer >= 0")
        for key in ("min_duration", "max_duration", "dither"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise bad(key, "must be a number >= 0")
        for key in ("frame_length_ms", "frame_shift_ms"):
            if not isinstance(getattr(self, key), (int, float)) or getattr(self, key) <= 0:
                raise bad(key, "must be a number > 0")
        if self.max_duration and self.max_duration < self.min_duration:
            raise bad("max_duration", f"is below min_duration={self.min_duration}")
        if self.subsampling_rate not in SUBSAMPLING_LAYERS:
            raise bad("subsampling_rate", f"must be one of {sorted(SUBSAMPLING_LAYERS)}")
        if not isinstance(self.prompt, str) or self.prompt.count(SPEECH_MARKER) != 1:
            raise bad("prompt", f"must contain the speech marker {SPEECH_MARKER!r} exactly once")
        for key in ("shuffle", "spec_aug", "pin_memory"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "must be true or false")


def add_data_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Add one ``--name`` option per DataConfig field (for tools and CLIs)."""
    for f in fields(DataConfig):
        if f.name in exclude:
            continue
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(f"--{f.name}", type=lambda s: s.lower() in ("1", "true", "yes"),
                                default=None, metavar="BOOL")
        elif isinstance(default, (int, float)):
            parser.add_argument(f"--{f.name}", type=type(default), default=None)
        else:
            parser.add_argument(f"--{f.name}", type=str, default=None)


def config_from_args(args: argparse.Namespace, base: Optional[dict] = None,
                     exclude: tuple[str, ...] = ()) -> DataConfig:
    """DataConfig from ``base`` overridden by every option given on the command line."""
    d = dict(base or {})
    for f in fields(DataConfig):
        v = None if f.name in exclude else getattr(args, f.name, None)
        if v is not None:
            d[f.name] = v
    return DataConfig.from_dict(d)
