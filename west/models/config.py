"""The ``model`` section (keys: docs/config.md); the data side needs only ``speech_shape()``."""
from __future__ import annotations

from dataclasses import field
from typing import Optional

from west.schema import section, setting
from west.shapes import ENCODER_TYPES, SUBSAMPLING_LAYERS, SpeechShape

POSTERIOR_TYPES = ("ctc_posterior", "ctc_compact")  # read the CTC head's posteriors
BACKENDS = ("auto", "sdpa_segments", "flash", "torch_varlen", "flex")  # west_varlen's kernels (models.attention)
LOSS_IMPLS = ("auto", "chunked", "plain", "liger", "cce")  # west.models.loss.linear_cross_entropy
ENCODER_BACKENDS = ("auto", "sdpa_segments", "flex")   # the Conformer's packed attention (models.conformer)


@section("model.encoder")
class ConformerConfig:
    # whisper: the encoder of the Hugging Face Whisper dir model.encoder.path (Conformer keys unused)
    type: str = setting("conformer", choices=ENCODER_TYPES, rule=(
        lambda v, c: v != "whisper" or bool(c.path), "whisper needs model.encoder.path (a Hugging Face Whisper dir)"))
    path: Optional[str] = None
    pad_to_30s: bool = False      # whisper: the stock padded encoder
    input_dim: int = setting(80, min=1)
    d_model: int = setting(256, min=1, rule=(lambda v, c: v % c.num_heads == 0,
                                             "must be divisible by model.encoder.num_heads"))
    num_heads: int = setting(4, min=1)
    ffn_dim: int = setting(2048, min=1)
    num_blocks: int = setting(12, min=1)
    conv_kernel: int = setting(15, rule=(lambda v, _: v % 2 == 1, "must be odd"))  # depthwise kernel
    subsampling_rate: int = setting(4, choices=tuple(SUBSAMPLING_LAYERS))
    dropout: float = setting(0.1, min=0)
    attn_dropout: float = setting(0.0, min=0)
    buckets_per_octave: Optional[int] = setting(8, min=0)  # packed attention grouping (None = exact lengths, 0 = one group)
    attn_backend: str = setting("auto", choices=ENCODER_BACKENDS)  # auto: flex for packed rows on CUDA
    gradient_checkpointing: bool = False
    pos_enc: str = setting("relative", choices=("relative", "wenet"))  # wenet: as WeNet's rel_pos computes it
    init: Optional[str] = setting(None, rule=(  # west-named safetensors loaded before training (not on resume)
        lambda v, c: c.type == "conformer", "is the Conformer's; Whisper's weights are in model.encoder.path"))


@section("model.projector")
class ProjectorConfig:
    stride: int = setting(2, min=1)         # encoder frames stacked per LLM slot
    hidden_dim: int = setting(2048, min=1)
    type: str = setting("mlp", choices=("mlp", *POSTERIOR_TYPES))
    dropout: float = setting(0.0, min=0)


@section("model.llm")
class LLMConfig:
    path: Optional[str] = None              # local dir for from_pretrained (weights + config)
    config: Optional[dict] = None           # HF config dict for from_config (random init) if no path
    attn_implementation: str = "west_varlen"  # or any stock name: sdpa, eager, flash_attention_2
    attn_backend: str = setting("auto", choices=BACKENDS)  # west_varlen's packed kernel
    dtype: str = setting("float32", choices=("float32", "bfloat16", "float16"))
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
    freeze_encoder_blocks: int = setting(0, min=0, rule=(  # whisper: checked in west.config.check_encoder
        lambda v, m: m.encoder.type == "whisper" or v <= m.encoder.num_blocks, "must be <= model.encoder.num_blocks"))
    freeze_llm: bool = True
    lora: Optional[LoraSettings] = None
    ctc_weight: float = setting(0.0, min=0, rule=(  # loss = CE + ctc_weight * CTC; 0 = no CTC head
        lambda v, m: v > 0 or m.projector.type not in POSTERIOR_TYPES,
        "must be > 0 with model.projector.type ctc_posterior or ctc_compact (the CTC loss trains their head)"))
    ctc_blank: Optional[int] = setting(None, min=0)  # None = an extra class after the vocabulary
    loss: str = setting("auto", choices=LOSS_IMPLS)  # the LLM's CE over the vocabulary (models.loss)
    loss_chunk_rows: int = setting(512, min=1)         # chunked loss: logits tiles of at most this x vocab

    def speech_shape(self) -> SpeechShape:
        """The geometry the data side needs (Whisper's window and mel bins from its dir's config)."""
        enc = self.encoder
        if enc.type != "whisper":
            return SpeechShape(enc.subsampling_rate, self.projector.stride, num_mel_bins=enc.input_dim)
        from west.models.whisper_encoder import whisper_geometry  # reads the dir's config.json (lazy: torch)

        n_mels, max_frames, _ = whisper_geometry(enc.path)
        return SpeechShape(projector_stride=self.projector.stride, encoder_type="whisper", max_frames=max_frames,
                           num_mel_bins=n_mels)

