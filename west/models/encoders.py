"""One seam for encoders: each encoder type is one module and one entry of ``ENCODERS``.

Nothing outside this file and the encoder's own module branches on an encoder type's name.
An entry says what is known before any weight is read (importing this file imports no torch):
where the class lives, the data side's feature kind it reads (``data.features``), whether it
is loaded from ``model.encoder.path``, whether it reads the section's Conformer keys, and, for
a released speech LLM, the ``model.type`` preset that takes encoder, projector and LLM from one
directory. The class (a :class:`west.models.layout.FlatEncoder`) answers the rest:

=================================  ===================================================
``from_config(cfg, attn_backend)``   build it (and load its weights)
``speech_shape(cfg, stride)``        frame formula, longest input, mel bins: the data side's SpeechShape
``num_layers(cfg)``                  what ``model.freeze_encoder_blocks`` counts, before building
``freeze_blocks(n)``                 what freezing the first n blocks means for it
``fsdp_units()``                     the modules FSDP2 shards one by one
``release_projector(path)``          model.projector keys a released model's dir fixes (read there)
``pretrained_projector()``           a released model's projector weights (else None)
``gradient_checkpointing``           on/off (property)
``attention_buckets``, ``packs_padded_input``   how the benchmark counts its attention
=================================  ===================================================

Adding an encoder: docs/models.md, "Adding an encoder".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Optional

from west.schema import ConfigError


@dataclass(frozen=True)
class EncoderType:
    name: str
    title: str                     # how reports name it
    module: str                    # imported on first use
    cls: str                       # the FlatEncoder subclass in ``module``
    features: str                  # the feature kind it reads (west.data.feature_kinds)
    path: str = ""                 # what model.encoder.path must be ("" = not read)
    conformer_keys: bool = False   # reads model.encoder's Conformer keys (d_model, ..., init)
    # a released speech LLM: model.type NAME with model.path DIR sets model.encoder {type, path},
    # model.llm.path and these model.projector keys; ``exporter`` writes DIR back in its own format
    release_projector: dict = field(default_factory=dict)
    exporter: str = ""             # "module:function(model, out_dir, tokenizer) -> Path"
    # more transformers model_types of the release's directories than its name (e.g. a part saved alone)
    model_types: tuple = ()
    # its language model where AutoModelForCausalLM has no class for the release's text config:
    # "module:function(path, hf_config, **from_pretrained kwargs) -> causal LM"
    llm: str = ""

    def load(self) -> Any:
        """The encoder class."""
        return getattr(import_module(self.module), self.cls)

    @property
    def is_release(self) -> bool:
        return bool(self.release_projector)


ENCODERS: dict[str, EncoderType] = {e.name: e for e in (
    EncoderType("conformer", "Conformer", "west.models.conformer", "ConformerEncoder", features="fbank", conformer_keys=True),
    EncoderType("whisper", "Whisper", "west.models.whisper_encoder", "WhisperPackedEncoder", features="whisper",
                path="a Hugging Face Whisper dir"),
    EncoderType("qwen2_audio", "Qwen2-Audio", "west.models.qwen2_audio", "Qwen2AudioPackedEncoder", features="whisper",
                path="a Hugging Face Qwen2-Audio dir (Qwen2AudioForConditionalGeneration)",
                release_projector={"type": "linear", "stride": 1},
                exporter="west.checkpoint.released:export_qwen2_audio"),
    EncoderType("qwen3_asr", "Qwen3-ASR", "west.models.qwen3_asr", "Qwen3ASRPackedEncoder", features="qwen3_asr",
                path="a Hugging Face Qwen3-ASR dir (Qwen3ASRForConditionalGeneration)",
                release_projector={"type": "mlp", "stride": 1},
                exporter="west.checkpoint.released:export_qwen3_asr"),
    EncoderType("qwen2_5_omni", "Qwen2.5-Omni", "west.models.qwen2_5_omni", "Qwen2_5OmniPackedEncoder",
                features="whisper", path="a Hugging Face Qwen2.5-Omni dir (Qwen2_5OmniForConditionalGeneration "
                "or its thinker alone)", release_projector={"type": "linear", "stride": 1},
                exporter="west.checkpoint.released:export_qwen2_5_omni", model_types=("qwen2_5_omni_thinker",),
                llm="west.models.qwen2_5_omni_llm:load_omni_llm"),
)}
ENCODER_TYPES = tuple(ENCODERS)
# released speech LLMs: each entry's name is the transformers model_type of its directory (release_of
# also knows an entry's other model_types)
RELEASE_TYPES = tuple(e.name for e in ENCODERS.values() if e.is_release)
# model.type: west's own assembly of the sections, or a released speech LLM loaded from model.path
MODEL_TYPES = ("west", *RELEASE_TYPES)


def encoder_type(name: str) -> EncoderType:
    """The entry of ``model.encoder.type`` ``name``."""
    if name not in ENCODERS:
        raise ConfigError(f"model.encoder.type: must be one of {ENCODER_TYPES}, got {name!r}")
    return ENCODERS[name]


def encoder_class(name: str) -> Any:
    return encoder_type(name).load()


def release_of(model_type: Optional[str]) -> Optional[EncoderType]:
    """The released speech LLM whose directories have config.json ``model_type`` (None: none)."""
    for e in ENCODERS.values():
        if e.is_release and model_type in (e.name, *e.model_types):
            return e
    return None


def release_llm(entry: EncoderType) -> Optional[Any]:
    """The function that loads ``entry``'s language model where it names one (None: AutoModelForCausalLM)."""
    if not entry.llm:
        return None
    module, fn = entry.llm.split(":")
    return getattr(import_module(module), fn)


def exporter(name: str) -> Optional[Any]:
    """The function that writes a run of encoder type ``name`` back in its released format (None: west's)."""
    entry = encoder_type(name)
    if not entry.exporter:
        return None
    module, fn = entry.exporter.split(":")
    return getattr(import_module(module), fn)
