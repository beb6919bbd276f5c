"""A run that started from a released speech LLM, written back in that model's own format.

``export_qwen2_audio``: a directory that ``Qwen2AudioForConditionalGeneration.from_pretrained``
loads: the released directory's config (audio tower, projector and language model shapes) and
its tokenizer / processor files, with the trained weights: the audio tower, the linear projector,
and the language model with any LoRA adapters merged. The registry entry of the encoder type
names its exporter (west.models.encoders); ``west-export`` calls it.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from west.models.speech_llm import SpeechLLM

# what the released directory holds besides config and weights: tokenizer, processor, templates
_CARRIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
            "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
            "processor_config.json", "generation_config.json")


def export_qwen2_audio(model: SpeechLLM, out_dir: str | Path, tokenizer=None) -> Path:
    """Write ``model`` (encoder type qwen2_audio) as a Qwen2AudioForConditionalGeneration directory.
    ``model`` is changed in place (its adapters are merged): export is a last step."""
    from transformers import AutoConfig, Qwen2AudioForConditionalGeneration  # heavy

    src = Path(model.encoder.path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    llm = model.llm.merge_and_unload() if hasattr(model.llm, "merge_and_unload") else model.llm
    model.llm = llm
    hf = Qwen2AudioForConditionalGeneration(AutoConfig.from_pretrained(src))
    with torch.no_grad():
        hf.model.audio_tower.load_state_dict(model.encoder.hf.state_dict())
        hf.model.multi_modal_projector.linear.load_state_dict(model.projector.net.state_dict())
        hf.model.language_model.load_state_dict(llm.model.state_dict())
        hf.lm_head.load_state_dict(llm.lm_head.state_dict())
    hf.to(next(llm.parameters()).dtype).save_pretrained(out)
    for name in _CARRIED:
        if (src / name).is_file() and not (out / name).exists():
            shutil.copy(src / name, out / name)
    if tokenizer is not None and not (out / "tokenizer_config.json").exists():
        tokenizer.save_pretrained(out)
    return out
