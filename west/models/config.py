"""The ``model`` section (keys: docs/config.md); the data side needs only ``speech_shape()``."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

from west.models.encoders import ENCODER_TYPES, MODEL_TYPES, encoder_class, encoder_type
from west.schema import require, section, setting
from west.shapes import SUBSAMPLING_LAYERS, SpeechShape

POSTERIOR_TYPES = ("ctc_posterior", "ctc_compact")  # read the CTC head's posteriors
BACKENDS = ("auto", "sdpa_segments", "flash", "torch_varlen", "flex")  # west_varlen's kernels (models.attention)
LOSS_IMPLS = ("auto", "chunked", "plain")  # west.models.loss.linear_cross_entropy
ENCODER_BACKENDS = ("auto", "sdpa_segments", "flex", "varlen")   # the Conformer's packed attention (models.conformer)
MLP_TARGETS = {"gate_proj", "up_proj", "down_proj", "all-linear"}   # LoRA targets that adapt a SwiGLU MLP


@section("model.encoder")
class ConformerConfig:
    # one section for every type of west.models.encoders; the Conformer's keys are read by it alone
    type: str = setting("conformer", choices=ENCODER_TYPES, rule=(
        lambda v, c: not encoder_type(v).path or bool(c.path),
        "needs model.encoder.path (a Hugging Face dir; see docs/models.md)"))
    path: Optional[str] = None
    pad_to_30s: bool = False      # an encoder with a 30 s window: the stock padded encoder
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
    # auto: segment SDPA (one group on CUDA), or with pos_enc wenet on CUDA a cu_seqlens kernel
    attn_backend: str = setting("auto", choices=ENCODER_BACKENDS, rule=(
        lambda v, c: v != "varlen" or c.pos_enc == "wenet",
        "varlen needs model.encoder.pos_enc wenet (its positional term folds into q and k; relative's does not)"))
    gradient_checkpointing: bool = False
    pos_enc: str = setting("relative", choices=("relative", "wenet"))  # wenet: as WeNet's rel_pos computes it
    init: Optional[str] = setting(None, rule=(  # west-named safetensors loaded before training (not on resume)
        lambda v, c: encoder_type(c.type).conformer_keys,
        "is the Conformer's; a pretrained encoder's weights are in model.encoder.path"))


EncoderConfig = ConformerConfig   # the model.encoder section, whichever the type


@section("model.projector")
class ProjectorConfig:
    stride: int = setting(2, min=1)         # encoder frames stacked per LLM slot
    hidden_dim: int = setting(2048, min=1)
    type: str = setting("mlp", choices=("mlp", "linear", *POSTERIOR_TYPES))  # linear: one Linear per group
    dropout: float = setting(0.0, min=0)


@section("model.llm")
class LLMConfig:
    path: Optional[str] = None              # local dir for from_pretrained (weights + config)
    config: Optional[dict] = None           # HF config dict for from_config (random init) if no path
    attn_implementation: str = "west_varlen"  # or any stock name: sdpa, eager, flash_attention_2
    attn_backend: str = setting("auto", choices=BACKENDS)  # west_varlen's packed kernel
    dtype: str = setting("float32", choices=("float32", "bfloat16", "float16"))
    gradient_checkpointing: bool = False
    # with gradient_checkpointing: recompute only the first N decoder layers (None = all): memory
    # left under a budget buys back the rest's forward replay
    checkpoint_layers: Optional[int] = setting(None, min=0, rule=(
        lambda v, c: v is None or c.gradient_checkpointing, "needs model.llm.gradient_checkpointing true"))
    # what gradient_checkpointing recomputes: layer, whole decoder layers; mlp, only each frozen
    # SwiGLU MLP's gate/up products from its kept input (west.models.mlp_checkpoint)
    checkpoint_scope: str = setting("layer", choices=("layer", "mlp"))
    # each stock RMSNorm as one torch.rms_norm call: one fused kernel each way on CUDA (west.models.fused_norm)
    fused_norm: bool = True

    def recomputes_mlps(self) -> bool:
        return self.gradient_checkpointing and self.checkpoint_scope == "mlp"



@section("model.lora")
class LoraSettings:
    r: int = setting(8, min=1)
    alpha: int = 16
    dropout: float = setting(0.05, min=0)
    target_modules: list[str] = setting(["q_proj", "k_proj", "v_proj", "o_proj"])


@section("model")
class SpeechLLMConfig:
    # west: the encoder/projector/llm sections as given; a released speech LLM (qwen2_audio): model.path
    # DIR holds encoder, projector, LLM, tokenizer and chat template, and sets the keys that say so
    type: str = setting("west", choices=MODEL_TYPES, rule=(
        lambda v, m: v == "west" or bool(m.path), "needs model.path (the released model's Hugging Face dir)"))
    path: Optional[str] = setting(None, rule=(
        lambda v, m: m.type != "west", "is read only with model.type set to a released model (e.g. qwen2_audio)"))
    encoder: ConformerConfig = field(default_factory=ConformerConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    freeze_encoder: bool = False
    freeze_encoder_blocks: int = setting(0, min=0, rule=(  # a pretrained encoder's: checked in west.config
        lambda v, m: not encoder_type(m.encoder.type).conformer_keys or v <= m.encoder.num_blocks,
        "must be <= model.encoder.num_blocks"))
    freeze_llm: bool = setting(True, rule=(
        lambda v, m: v or m.lora is not None or not m.llm.recomputes_mlps(),
        "trains the LLM's MLPs: model.llm.checkpoint_scope mlp takes frozen ones only (use layer)"))
    lora: Optional[LoraSettings] = setting(None, rule=(
        lambda v, m: not m.llm.recomputes_mlps() or not set(v.target_modules) & MLP_TARGETS,
        "target_modules adapt the LLM's MLP: model.llm.checkpoint_scope mlp takes frozen MLPs only (use layer)"))
    ctc_weight: float = setting(0.0, min=0, rule=(  # loss = CE + ctc_weight * CTC; 0 = no CTC head
        lambda v, m: v > 0 or m.projector.type not in POSTERIOR_TYPES,
        "must be > 0 with model.projector.type ctc_posterior or ctc_compact (the CTC loss trains their head)"))
    ctc_blank: Optional[int] = setting(None, min=0)  # None = an extra class after the vocabulary
    loss: str = setting("auto", choices=LOSS_IMPLS)  # the LLM's CE over the vocabulary (models.loss)
    loss_chunk_rows: int = setting(512, min=1)         # chunked loss: logits tiles of at most this x vocab

    def speech_shape(self) -> SpeechShape:
        """The geometry the data side needs, from the encoder type's entry (a pretrained encoder's
        window and mel bins are read from its dir's config)."""
        return encoder_class(self.encoder.type).speech_shape(self.encoder, self.projector.stride)

    def derive(self) -> None:
        """model.type NAME + model.path DIR: the keys the released model fixes (encoder type and path,
        projector, LLM path), each refused when given otherwise (schema.check calls this)."""
        if self.type == "west" or not self.path:
            return
        entry = encoder_type(self.type)
        projector = {**entry.release_projector, **entry.load().release_projector(self.path)}
        fixed = {"encoder": {"type": entry.name, "path": self.path}, "projector": projector,
                 "llm": {"path": self.path}}
        for name, keys in fixed.items():
            sec = getattr(self, name)
            default = type(sec)()
            for key, value in keys.items():
                given = getattr(sec, key)
                require(given in (value, getattr(default, key)), f"model.{name}.{key}",
                        f"is set by model.type {self.type} (to {value!r}); leave it out, got {given!r}")
            setattr(self, name, dataclasses.replace(sec, **keys))
