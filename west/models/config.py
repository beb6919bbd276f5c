"""Model configuration: dataclasses that round-trip through dict/YAML/JSON, each limit next to
its field (checked on construction, west.schema). The data side needs only ``speech_shape()``.
"""
from __future__ import annotations

from dataclasses import field
from functools import lru_cache
from typing import Optional

from west.schema import section, setting
from west.shapes import ENCODER_TYPES, SUBSAMPLING_LAYERS, SpeechShape

POSTERIOR_TYPES = ("ctc_posterior", "ctc_compact")  # read the CTC head's posteriors
PROJECTOR_TYPES = ("mlp", *POSTERIOR_TYPES)
LLM_DTYPES = ("float32", "bfloat16", "float16")
POS_ENCODINGS = ("relative", "wenet")


@section("model.encoder")
class ConformerConfig:
    # conformer: west's packed Conformer, built from the keys below. whisper: the encoder of the
    # local Hugging Face Whisper dir model.encoder.path, run packed (west/models/whisper_encoder.py);
    # its architecture is that dir's config, so the Conformer keys below are not used.
    type: str = setting("conformer", choices=ENCODER_TYPES, rule=(
        lambda v, c: v != "whisper" or bool(c.path),
        "whisper needs model.encoder.path DIR (a local Hugging Face Whisper directory)"))
    path: Optional[str] = None
    pad_to_30s: bool = False      # whisper: the stock padded encoder (every utterance padded to 30 s)
    input_dim: int = setting(80, min=1)
    d_model: int = setting(256, min=1, rule=(lambda v, c: v % c.num_heads == 0,
                                             "must be divisible by model.encoder.num_heads"))
    num_heads: int = setting(4, min=1)
    ffn_dim: int = setting(2048, min=1)
    num_blocks: int = setting(12, min=1)
    conv_kernel: int = setting(15, rule=(lambda v, _: v % 2 == 1, "must be odd"))  # depthwise kernel
    subsampling_rate: int = setting(4, choices=tuple(SUBSAMPLING_LAYERS))  # west.shapes.SUBSAMPLING_LAYERS
    dropout: float = setting(0.1, min=0)           # residual / FFN / subsampling output dropout
    attn_dropout: float = setting(0.0, min=0)      # dropout on attention probabilities
    buckets_per_octave: Optional[int] = 8          # packed attention grouping (None = exact lengths)
    gradient_checkpointing: bool = False
    # Positional score term: relative = (q+v)·W_pos·pe(i−j) (Transformer-XL / ESPnet); wenet =
    # (q+v)·W_pos·pe(j), the key's position within its utterance, as WeNet's rel_pos computes it
    # (what tools/convert_wenet_checkpoint.py writes, so a converted encoder is the same function).
    pos_enc: str = setting("relative", choices=POS_ENCODINGS)
    # Encoder weights (safetensors, west names) loaded strictly before training starts, e.g. the
    # encoder.safetensors of tools/convert_wenet_checkpoint.py; not re-read on resume or decode.
    init: Optional[str] = None

    @classmethod
    def preset(cls, name: str, **overrides) -> "ConformerConfig":
        """``tiny`` (CPU tests/recipe) or ``base`` (≈34M, WeNet AIShell-sized: 256-d, 2048 ff, 12 blocks)."""
        presets = {
            "tiny": dict(d_model=64, num_heads=4, ffn_dim=128, num_blocks=2, conv_kernel=7),
            "base": dict(d_model=256, num_heads=4, ffn_dim=2048, num_blocks=12, conv_kernel=15),
        }
        if name not in presets:
            raise ValueError(f"unknown encoder preset {name!r}; choose from {sorted(presets)}")
        return cls(**{**presets[name], **overrides})


@section("model.projector")
class ProjectorConfig:
    stride: int = setting(2, min=1)         # encoder frames stacked per LLM slot (ceil, zero-filled tail)
    hidden_dim: int = setting(2048, min=1)  # MLP hidden size
    # mlp: stacked frames -> MLP. ctc_posterior: the CTC head's posteriors times the LLM's
    # input embeddings; ctc_compact: those soft tokens one per CTC segment, blanks dropped
    # (both need model.ctc_weight > 0; west/models/projector.py)
    type: str = setting("mlp", choices=PROJECTOR_TYPES)
    dropout: float = setting(0.0, min=0)


@section("model.llm")
class LLMConfig:
    path: Optional[str] = None              # local dir for from_pretrained (weights + config)
    config: Optional[dict] = None           # HF config dict for from_config (random init) if no path
    attn_implementation: str = "west_varlen"  # or any stock name: sdpa, eager, flash_attention_2
    attn_backend: str = "auto"              # west_varlen packed backend: auto|sdpa_segments|flash|flex
    dtype: str = setting("float32", choices=LLM_DTYPES)
    gradient_checkpointing: bool = False


@section("model.lora")
class LoraSettings:
    r: int = setting(8, min=1)
    alpha: int = 16
    dropout: float = setting(0.05, min=0)
    target_modules: list[str] = setting(["q_proj", "k_proj", "v_proj", "o_proj"])


@section("model")
class SpeechLLMConfig:
    encoder: ConformerConfig = field(default_factory=ConformerConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    freeze_encoder: bool = False
    # Freeze the subsampling and the first N Conformer blocks (fine-tuning a pretrained
    # encoder: the low blocks keep their acoustics, the top ones adapt); freeze_encoder freezes all.
    # (whisper: its convolutions and first N layers, checked against its config when built)
    freeze_encoder_blocks: int = setting(0, min=0, rule=(
        lambda v, m: m.encoder.type == "whisper" or v <= m.encoder.num_blocks, "must be <= model.encoder.num_blocks"))
    freeze_llm: bool = True        # WEST default: train encoder + projector, LLM frozen
    lora: Optional[LoraSettings] = None
    # Hybrid CTC/LLM loss = CE + ctc_weight * CTC of the encoder output against the transcript
    # tokens (a head over the LLM vocabulary + blank): a direct, alignment-free signal for the
    # encoder early on (Kim et al., 2017); 0 = no head.
    ctc_weight: float = setting(0.0, min=0, rule=(
        lambda v, m: v > 0 or m.projector.type not in POSTERIOR_TYPES,
        "must be > 0 with model.projector.type ctc_posterior or ctc_compact (the CTC head it reads "
        "posteriors from is trained by the CTC loss)"))
    # The CTC blank: None = an extra class after the vocabulary (with its own learned
    # embedding for the posterior projectors), or a token id (e.g. the pad token)
    # whose embedding then stands for blank frames.
    ctc_blank: Optional[int] = setting(None, min=0)

    def speech_shape(self) -> SpeechShape:
        """The geometry the data side needs (how many LLM slots T frames take); for Whisper,
        its window and mel bins are read from ``model.encoder.path``'s config."""
        if self.encoder.type == "whisper":
            n_mels, max_frames = whisper_geometry(self.encoder.path)
            return SpeechShape(projector_stride=self.projector.stride, encoder_type="whisper",
                               max_frames=max_frames, num_mel_bins=n_mels)
        return SpeechShape(self.encoder.subsampling_rate, self.projector.stride)


@lru_cache(maxsize=8)
def whisper_geometry(path: str) -> tuple[int, int]:
    """(num_mel_bins, max mel frames) of the Whisper dir ``path`` (read once per path)."""
    from west.models.whisper_encoder import read_whisper_config, whisper_max_frames

    conf = read_whisper_config(path)
    return int(conf.num_mel_bins), whisper_max_frames(conf)
