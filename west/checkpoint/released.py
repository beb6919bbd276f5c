"""A run that started from a released speech LLM, written back in that model's own format.

Each exporter writes a directory that the model's own ``from_pretrained`` loads: the released
directory's config (audio encoder, projector and language model shapes) and its tokenizer /
processor files, with the trained weights: the audio encoder, the projector, and the language
model with any LoRA adapters merged.

* ``export_qwen2_audio``: ``Qwen2AudioForConditionalGeneration`` (projector ``multi_modal_projector.linear``);
* ``export_qwen3_asr``: ``Qwen3ASRForConditionalGeneration`` (projector ``multi_modal_projector.linear_1``,
  GELU, ``linear_2``: west's mlp projector's ``net.0`` and ``net.3``);
* ``export_qwen2_5_omni``: ``Qwen2_5OmniThinkerForConditionalGeneration``, the thinker alone (projector:
  the audio tower's ``proj``; the vision tower as the source directory has it).

The registry entry of the encoder type names its exporter (west.models.encoders); ``west-export``
calls it.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from west.models.qwen2_5_omni import load_thinker_part, thinker_config
from west.models.speech_llm import SpeechLLM
from west.models.whisper_encoder import hf_part

# what the released directory holds besides config and weights: tokenizer, processor, templates
_CARRIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
            "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
            "processor_config.json", "generation_config.json")


def export_qwen2_audio(model: SpeechLLM, out_dir: str | Path, tokenizer=None) -> Path:
    """Write ``model`` (encoder type qwen2_audio) as a Qwen2AudioForConditionalGeneration directory.
    ``model`` is changed in place (its adapters are merged): export is a last step."""
    from transformers import Qwen2AudioForConditionalGeneration  # heavy

    def copy(hf: nn.Module, llm: nn.Module) -> None:
        hf_part(hf).load_state_dict(model.encoder.hf.state_dict())
        hf.model.multi_modal_projector.linear.load_state_dict(model.projector.net.state_dict())
        _text_model(hf).load_state_dict(llm.model.state_dict())
        hf.lm_head.load_state_dict(llm.lm_head.state_dict())

    return _export(model, out_dir, tokenizer, Qwen2AudioForConditionalGeneration, copy)


def export_qwen3_asr(model: SpeechLLM, out_dir: str | Path, tokenizer=None) -> Path:
    """Write ``model`` (encoder type qwen3_asr) as a Qwen3ASRForConditionalGeneration directory.
    ``model`` is changed in place (its adapters are merged): export is a last step."""
    from transformers import Qwen3ASRForConditionalGeneration  # heavy

    def copy(hf: nn.Module, llm: nn.Module) -> None:
        hf_part(hf).load_state_dict(model.encoder.hf.state_dict())
        net = model.projector.net
        hf.model.multi_modal_projector.linear_1.load_state_dict(net[0].state_dict())
        hf.model.multi_modal_projector.linear_2.load_state_dict(net[3].state_dict())
        _text_model(hf).load_state_dict(llm.model.state_dict())
        hf.lm_head.load_state_dict(llm.lm_head.state_dict())   # the same table when the release ties them

    return _export(model, out_dir, tokenizer, Qwen3ASRForConditionalGeneration, copy)

def export_qwen2_5_omni(model: SpeechLLM, out_dir: str | Path, tokenizer=None) -> Path:
    """Write ``model`` (encoder type qwen2_5_omni) as a Qwen2_5OmniThinkerForConditionalGeneration
    directory: the thinker of a full release, without its talker and token2wav (which read the
    thinker's hidden states: a fine-tuned thinker is not the one they were trained with). ``model``
    is changed in place (its adapters are merged): export is a last step."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration  # heavy

    def build(conf) -> nn.Module:
        return Qwen2_5OmniThinkerForConditionalGeneration(thinker_config(conf))

    def copy(hf: nn.Module, llm: nn.Module) -> None:
        proj = model.projector.net
        hf_part(hf).load_state_dict({**model.encoder.hf.state_dict(), "proj.weight": proj.weight,
                                     "proj.bias": proj.bias})
        hf_part(hf, "visual").load_state_dict(load_thinker_part(model.encoder.path, "visual").state_dict())
        _text_model(hf).load_state_dict(llm.model.state_dict())
        hf.lm_head.load_state_dict(llm.lm_head.state_dict())

    return _export(model, out_dir, tokenizer, build, copy)


def _text_model(hf: nn.Module) -> nn.Module:
    """The released model's decoder stack: ``model.language_model``, or (a Qwen2.5-Omni thinker in
    transformers 5.17, the GPU machines' version) ``model`` itself."""
    return getattr(hf.model, "language_model", hf.model)


def _export(model: SpeechLLM, out_dir: str | Path, tokenizer, cls: type,
            copy: Callable[[nn.Module, nn.Module], None]) -> Path:
    """The release's class ``cls`` built from the source directory's config, ``copy(hf, llm)`` of the
    trained weights into it (the LLM's adapters merged first), saved with the directory's other files."""
    from transformers import AutoConfig  # heavy

    src = Path(model.encoder.path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    llm = model.llm.merge_and_unload() if hasattr(model.llm, "merge_and_unload") else model.llm
    model.llm = llm
    hf = cls(AutoConfig.from_pretrained(src))
    with torch.no_grad():
        copy(hf, llm)
    hf.to(next(llm.parameters()).dtype).save_pretrained(out)
    for name in _CARRIED:
        if (src / name).is_file() and not (out / name).exists():
            shutil.copy(src / name, out / name)
    if tokenizer is not None and not (out / "tokenizer_config.json").exists():
        tokenizer.save_pretrained(out)
    return out
