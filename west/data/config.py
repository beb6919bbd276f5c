"""Every option of the data pipeline in one dataclass, each limit next to its field.

Loaded as the ``data`` section (west.config) or built in code, it is checked the same way
(west.schema), naming the key. The model's geometry is not here: it comes as a SpeechShape.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from west.data.packing import ALGORITHMS, COSTS
from west.schema import section, setting
from west.shapes import SPEECH_MARKER, SpeechShape

ENCODER_LAYOUTS = ("packed", "padded")
DATA_TYPES = ("auto", "raw", "shard", "kaldi")
FEATURES = ("fbank", "whisper")
WHISPER_RATE = 16000


def _not_whisper(what: str) -> tuple:
    return (lambda v, d: d.features != "whisper", f"must be none with data.features whisper ({what})")


def _is_policy(name: str, _conf: Any) -> bool:
    from west.data.policies import POLICIES  # the one registry of batch modes (it imports this module)

    return name in POLICIES


@section("data")
class DataConfig:
    # batching
    batch_type: str = setting("static", rule=(_is_policy, "must name a policy of west.data.policies.POLICIES"))
    batch_size: int = setting(32, min=1)                # static: samples per batch
    max_tokens_in_batch: int = setting(4096, min=1)     # dynamic: longest * n_samples <= this (padded LLM tokens)
    pack_tokens: int = setting(8192, min=1)             # pack: LLM tokens a row holds at most
    pack_pad_multiple: int = setting(8, min=0)          # pack: width = longest row rounded up (0 = pack_tokens)
    pack_algorithm: str = setting("bfd", choices=ALGORITHMS)  # nf (next-fit baseline) | ffd | bfd
    pack_cost: str = setting("linear", choices=COSTS)   # linear | square: what balances ranks' packs in a step
    encoder_layout: str = setting("packed", choices=ENCODER_LAYOUTS)  # pack: feats packed (ΣT,F) or padded
    # input and order
    data_type: str = setting("auto", choices=DATA_TYPES)  # auto | raw (jsonl) | shard (tar list) | kaldi
    weights: Optional[list[float]] = setting(None, rule=(  # one per train list; None = concatenate
        lambda v, _: all(w > 0 for w in v), "must be positive numbers (one per train list)"))
    plan_window: int = setting(100000, min=1)           # utterances per planning window
    shuffle: bool = True                                # training only
    sort_buffer: int = setting(500, min=1)              # dynamic: sort by length within windows of this size
    min_duration: float = setting(0.0, min=0)           # seconds; 0 = no limit
    max_duration: float = setting(0.0, min=0, rule=(    # seconds; 0 = no limit
        lambda v, d: not v or v >= d.min_duration, "must be 0 (no limit) or >= data.min_duration"))
    # features: fbank (Kaldi log-mel + cmvn) | whisper (WhisperFeatureExtractor's log-mel, per
    # utterance, no 30 s padding; its bin count is the Whisper model's num_mel_bins)
    features: str = setting("fbank", choices=FEATURES)
    sample_rate: int = setting(16000, min=1, rule=(
        lambda v, d: d.features != "whisper" or v == WHISPER_RATE, "must be 16000 with data.features whisper"))
    num_mel_bins: int = setting(80, min=1)
    frame_length_ms: float = setting(25.0, gt=0)
    frame_shift_ms: float = setting(10.0, gt=0)
    dither: float = setting(1.0, min=0)                 # training only, on the int16 scale (Kaldi convention)
    cmvn: Optional[str] = setting(None, rule=_not_whisper(   # JSON from tools/compute_cmvn.py (or WeNet's)
        "Whisper's log-mel is normalised by its own formula, no CMVN"))
    spec_aug: bool = False                              # training only
    spec_aug_num_t_mask: int = setting(2, min=0)
    spec_aug_num_f_mask: int = setting(2, min=0)
    spec_aug_max_t: int = setting(50, min=0)
    spec_aug_max_f: int = setting(10, min=0)
    # prompt: the user turn; the marker stands for the speech
    prompt: str = setting(SPEECH_MARKER + "Transcribe the speech.", rule=(
        lambda v, _: v.count(SPEECH_MARKER) == 1, f"must contain the speech marker {SPEECH_MARKER!r} exactly once"))
    system_prompt: Optional[str] = None
    # loader
    num_workers: int = setting(0, min=0)
    prefetch_factor: int = setting(2, min=1)
    pin_memory: bool = False
    max_warnings: int = setting(20, min=0)              # warnings per skip category per worker and epoch


def for_shape(conf: DataConfig, shape: SpeechShape) -> DataConfig:
    """``conf`` as the model's encoder reads it: whisper features go with a Whisper encoder only,
    and take the model's mel bins (its config says 80 or 128)."""
    whisper_feats, whisper_enc = conf.features == "whisper", shape.encoder_type == "whisper"
    if whisper_feats != whisper_enc:
        raise ValueError(f"data.features {conf.features} does not match model.encoder.type {shape.encoder_type} "
                         "(whisper features go with the whisper encoder, fbank with the conformer)")
    if whisper_feats and shape.num_mel_bins and conf.num_mel_bins != shape.num_mel_bins:
        return dataclasses.replace(conf, num_mel_bins=shape.num_mel_bins)
    return conf
