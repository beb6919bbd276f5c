"""Model configuration: plain dataclasses that round-trip through dict/YAML/JSON.

The data side needs exactly two numbers from here, ``encoder.subsampling_rate``
and ``projector.stride`` (fed to ``west.shapes.num_speech_tokens``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from west.shapes import SUBSAMPLING_LAYERS, SpeechShape


@dataclass
class ConformerConfig:
    input_dim: int = 80
    d_model: int = 256
    num_heads: int = 4
    ffn_dim: int = 2048
    num_blocks: int = 12
    conv_kernel: int = 15          # depthwise kernel, odd
    subsampling_rate: int = 4      # 4, 6 or 8 (west.shapes.SUBSAMPLING_LAYERS)
    dropout: float = 0.1           # residual / FFN / subsampling output dropout
    attn_dropout: float = 0.0      # dropout on attention probabilities
    buckets_per_octave: Optional[int] = 8  # packed attention grouping (None = exact lengths)
    gradient_checkpointing: bool = False

    def __post_init__(self):
        if self.subsampling_rate not in SUBSAMPLING_LAYERS:
            raise ValueError(f"encoder.subsampling_rate must be one of {sorted(SUBSAMPLING_LAYERS)}")
        if self.conv_kernel % 2 != 1:
            raise ValueError(f"encoder.conv_kernel must be odd, got {self.conv_kernel}")
        if self.d_model % self.num_heads:
            raise ValueError(f"encoder.d_model {self.d_model} not divisible by num_heads {self.num_heads}")

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


PROJECTOR_TYPES = ("mlp", "ctc_posterior")


@dataclass
class ProjectorConfig:
    stride: int = 2               # encoder frames stacked per LLM slot (ceil, zero-filled tail)
    hidden_dim: int = 2048        # MLP hidden size
    # mlp: stacked frames -> MLP. ctc_posterior: the CTC head's posteriors times the LLM's
    # input embeddings (needs model.ctc_weight > 0; west/models/projector.py)
    type: str = "mlp"
    dropout: float = 0.0

    def __post_init__(self):
        if self.stride < 1:
            raise ValueError(f"projector.stride must be >= 1, got {self.stride}")
        if self.type not in PROJECTOR_TYPES:
            raise ValueError(f"projector.type must be one of {PROJECTOR_TYPES}, got {self.type!r}")


@dataclass
class LLMConfig:
    path: Optional[str] = None              # local dir for from_pretrained (weights + config)
    config: Optional[dict] = None           # HF config dict for from_config (random init) if no path
    attn_implementation: str = "west_varlen"  # or any stock name: sdpa, eager, flash_attention_2
    attn_backend: str = "auto"              # west_varlen packed backend: auto|sdpa_segments|flash|flex
    dtype: str = "float32"                  # float32 | bfloat16 | float16
    gradient_checkpointing: bool = False


@dataclass
class LoraSettings:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class SpeechLLMConfig:
    encoder: ConformerConfig = field(default_factory=ConformerConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    freeze_encoder: bool = False
    freeze_llm: bool = True        # WEST default: train encoder + projector, LLM frozen
    lora: Optional[LoraSettings] = None
    # Hybrid CTC/LLM training: loss = CE + ctc_weight * CTC of the encoder output against the
    # transcript tokens (a linear head over the LLM vocabulary + blank). It gives the encoder
    # a direct, alignment-free signal early on (Kim et al., 2017); 0 = no head.
    ctc_weight: float = 0.0
    # The CTC blank: None = an extra class after the vocabulary (with its own learned
    # embedding for the ctc_posterior projector), or a token id (e.g. the pad token)
    # whose embedding then stands for blank frames.
    ctc_blank: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.ctc_weight, (int, float)) or self.ctc_weight < 0:
            raise ValueError(f"model.ctc_weight must be a number >= 0, got {self.ctc_weight!r}")
        if self.ctc_blank is not None and (isinstance(self.ctc_blank, bool) or not isinstance(self.ctc_blank, int)
                                           or self.ctc_blank < 0):
            raise ValueError(f"model.ctc_blank must be a token id >= 0 or null, got {self.ctc_blank!r}")
        # Nested YAML mappings arrive as dicts (e.g. via the trainer's section schema).
        for name, klass in (("encoder", ConformerConfig), ("projector", ProjectorConfig),
                            ("llm", LLMConfig), ("lora", LoraSettings)):
            v = getattr(self, name)
            if isinstance(v, dict):
                setattr(self, name, _build(klass, v, f"model.{name}"))
        if self.projector.type == "ctc_posterior" and not self.ctc_weight > 0:
            raise ValueError("model.projector.type ctc_posterior needs model.ctc_weight > 0 "
                             "(the CTC head it reads posteriors from is trained by the CTC loss)")

    def speech_shape(self) -> SpeechShape:
        """The geometry the data side needs (how many LLM slots T frames take)."""
        return SpeechShape(self.encoder.subsampling_rate, self.projector.stride)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeechLLMConfig":
        """Build from a nested dict (YAML ``model`` section). Unknown keys raise, naming the key."""
        return _build(cls, dict(d or {}), "model")


def _build(klass, values: dict, where: str):
    names = {f.name for f in fields(klass)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"unknown keys in {where}: {sorted(f'{where}.{k}' for k in unknown)}")
    return klass(**values)
