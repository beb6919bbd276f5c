"""Qwen2.5-Omni's language model as a stock-shaped causal LM: ``.model`` (the thinker's own
``Qwen2_5OmniThinkerTextModel``) and ``.lm_head``, loaded from the thinker's rows of a release.

transformers has no ``AutoModelForCausalLM`` class for the thinker's text config, and the thinker
class itself carries the audio and vision towers; west needs only the language model, shaped as
every other LLM it trains (``get_decoder()``, ``get_input_embeddings()``, a Linear output
embedding, ``generate``, peft's LoRA). The layers, norms and rotary embedding are transformers'
own; nothing of the model's computation is rewritten here.

Positions: the thinker's rotary embedding takes three position rows (temporal, height, width;
``mrope_section`` splits the frequencies among them). For text and audio, ``get_rope_index``
advances all three by one per token, audio tokens included (each audio part gets as many positions
as it has ``<|AUDIO|>`` tokens, between its start and end token), so a sample's 3 x L positions are
its 1-D positions repeated (tests/test_models_qwen2_5_omni.py checks this against the thinker's
``get_rope_index``). :func:`mrope_position_ids` builds them from west's per-sample positions, which
restart at 0 for every sample of a packed row, and puts the 1-D row first (the ``(4, R, L)`` form
the text model reads as "packed"): its stock attention then finds the samples' boundaries there,
and west's finds them in ``cu_seq_lens_q``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniTextConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniDecoderLayer,
    Qwen2_5OmniThinkerTextModel,
)

# thinker rows -> this model's: a full release's ``thinker.`` prefix dropped, the thinker's language
# model (``model.*`` as released, ``model.language_model.*`` in transformers' own layout) as ``model.*``
LLM_KEYS = {r"^(thinker\.)?model\.(language_model\.)?": "model.", r"^thinker\.lm_head\.": "lm_head."}


def mrope_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(R, L) per-sample positions -> (4, R, L): the 1-D positions, then the thinker's temporal,
    height and width positions of text and audio tokens (each the 1-D position)."""
    return position_ids[None].expand(4, -1, -1)


class MropeTextModel(Qwen2_5OmniThinkerTextModel):
    """The thinker's text model, given west's (R, L) positions as its (4, R, L) multimodal ones."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        if position_ids is not None and position_ids.dim() == 2:
            position_ids = mrope_position_ids(position_ids)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **kwargs)


class Qwen2_5OmniTextForCausalLM(PreTrainedModel, GenerationMixin):
    """The thinker's language model and output head (``lm_head``), named as a causal LM's."""

    config_class = Qwen2_5OmniTextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen2_5OmniDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_attention_backend = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _can_record_outputs = {"hidden_states": Qwen2_5OmniDecoderLayer}

    def __init__(self, config: Qwen2_5OmniTextConfig):
        super().__init__(config)
        self.model = MropeTextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, use_cache: Optional[bool] = None,
                logits_to_keep: int | torch.Tensor = 0, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states, **_cache(out))


def _cache(out) -> dict:
    """The key cache of a model output, under the name this transformers gives it (``cache`` since 5.2x,
    ``past_key_values`` in the 5.17 the GPU machines run)."""
    name = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    return {name: getattr(out, name, None)}


def load_omni_llm(path: Optional[str], hf_config=None, **kw) -> nn.Module:
    """The thinker's language model of the Qwen2.5-Omni dir ``path`` (a full release or a thinker
    alone; only its ``thinker.model.*`` / ``model.*`` and ``lm_head`` rows are read), or built
    from ``hf_config`` (either config) with fresh weights. ``kw``: attn_implementation, dtype."""
    from transformers import AutoConfig  # heavy
    from transformers.utils import logging as hf_logging  # heavy

    conf = hf_config if hf_config is not None else AutoConfig.from_pretrained(path)
    text = conf.get_text_config()
    if hf_config is not None:
        return Qwen2_5OmniTextForCausalLM._from_config(text, **kw)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # the towers', talker's and token2wav's rows are "unexpected" by design
    try:
        llm, info = Qwen2_5OmniTextForCausalLM.from_pretrained(path, config=text, key_mapping=LLM_KEYS,
                                                               output_loading_info=True, **kw)
    finally:
        hf_logging.set_verbosity(level)
    missing = sorted(info["missing_keys"])
    if missing:
        raise ValueError(f"model.path {path!r}: the checkpoint lacks language model weights {missing[:5]}")
    return llm
