"""The ``data`` section (keys: docs/config.md); the model's geometry comes apart, as a SpeechShape."""
from __future__ import annotations

import dataclasses
from typing import Optional

from west.data.packing import ALGORITHMS, COSTS
from west.schema import require, section, setting
from west.shapes import SPEECH_MARKER, SpeechShape


@section("data")
class DataConfig:
    # batching
    batch_type: str = setting("static", rule=(  # looked up when checked: the policies' module is heavy
        lambda v, _: v in _policies(), "must be a key of west.data.policies.POLICIES"))
    batch_size: int = setting(32, min=1)                # static
    max_tokens_in_batch: int = setting(4096, min=1)     # dynamic: longest * n_samples <= this
    pack_tokens: int = setting(8192, min=1)             # pack: LLM tokens a row holds at most
    pack_pad_multiple: int = setting(8, min=0)          # pack: 0 = every row pack_tokens wide
    pack_algorithm: str = setting("bfd", choices=ALGORITHMS)
    pack_cost: str = setting("linear", choices=COSTS)   # what balances the ranks' packs in a step
    encoder_layout: str = setting("packed", choices=("packed", "padded"))  # pack: feats (ΣT, F) or padded
    # pack: the prompt's tokens before the speech (system turn, user header), the same in every sample,
    # laid out once per row and attended to by every sample in it (exact; west.models.shared_prefix)
    shared_prefix: bool = setting(False, rule=(
        lambda v, d: not v or _policies()[d.batch_type].packs_rows,
        "needs a batch_type that packs rows (pack): a padded row holds one sample"))
    # input and order
    # raw = jsonl, shard = tar list, lhotse = CutSet / recordings + supervisions, shar = Lhotse Shar dir,
    # hf = Hugging Face dataset (save_to_disk dir, parquet); auto detects it
    data_type: str = setting("auto", choices=("auto", "raw", "shard", "kaldi", "lhotse", "shar", "hf"))
    # hf: column names (a column is used when the dataset has it)
    audio_column: str = "audio"                         # Audio {bytes, path} cells, or bytes / path cells
    text_column: Optional[str] = None                   # None: the first of text, sentence, transcription, ...
    duration_column: str = "duration"                   # seconds; absent: tools/compute_lengths.py's index
    key_column: str = "id"                              # absent: NAME:ROW
    messages_column: str = "messages"                   # role/content conversations, as in jsonl
    weights: Optional[list[float]] = setting(None, rule=(  # one per train list; None = concatenate
        lambda v, _: all(w > 0 for w in v), "must be positive numbers (one per train list)"))
    plan_window: int = setting(100000, min=1)           # utterances per planning window
    shuffle: bool = True                                # training only
    sort_buffer: int = setting(500, min=1)              # dynamic: sort by length within windows of this size
    min_duration: float = setting(0.0, min=0)           # seconds; 0 = no limit
    max_duration: float = setting(0.0, min=0, rule=(    # seconds; 0 = no limit
        lambda v, d: not v or v >= d.min_duration, "must be 0 (no limit) or >= data.min_duration"))
    # features: a key of west.data.features.FEATURE_KINDS, the one the model's encoder reads:
    # fbank (Kaldi log-mel + cmvn) | whisper (the Whisper model's log-mel and bin count) | qwen3_asr
    # (Qwen3-ASR's processor's log-mel)
    features: str = setting("fbank", rule=(
        lambda v, _: v in _kinds(), "must be a key of west.data.features.FEATURE_KINDS (fbank, whisper, qwen3_asr)"))
    sample_rate: int = setting(16000, min=1, rule=(
        lambda v, d: _kinds()[d.features].sample_rate in (None, v),
        "must be the rate data.features needs (16000 with whisper and qwen3_asr)"))
    num_mel_bins: int = setting(80, min=1)
    frame_length_ms: float = setting(25.0, gt=0)
    frame_shift_ms: float = setting(10.0, gt=0)
    dither: float = setting(1.0, min=0)                 # training only, on the int16 scale
    cmvn: Optional[str] = setting(None, rule=(          # JSON from tools/compute_cmvn.py (or WeNet's)
        lambda v, d: _kinds()[d.features].cmvn,
        "must be none with a data.features that normalises itself (whisper: its log-mel)"))
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
    max_warnings: int = setting(20, min=0)              # per skip category, worker and epoch


def _kinds() -> dict:
    """west.data.features.FEATURE_KINDS, looked up when a key is checked."""
    from west.data.features import FEATURE_KINDS  # heavy (kaldi-native-fbank, soundfile, soxr)

    return FEATURE_KINDS


def _policies() -> dict:
    """west.data.policies.POLICIES, looked up when a key is checked."""
    from west.data.policies import POLICIES  # heavy (torch)

    return POLICIES


def for_shape(conf: DataConfig, shape: SpeechShape) -> DataConfig:
    """``conf`` as the model's encoder reads it: matching features, and the model's mel bins if it fixes them."""
    require(conf.features == shape.features, "data.features",
            f"{conf.features} does not match model.encoder.type {shape.encoder_type}, which reads "
            f"--data.features {shape.features}")
    return dataclasses.replace(conf, num_mel_bins=shape.num_mel_bins or conf.num_mel_bins)
