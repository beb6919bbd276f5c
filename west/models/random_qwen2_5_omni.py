"""A randomly initialised Qwen2.5-Omni directory, laid out as the release ships it, at toy sizes:
the thinker alone (``Qwen2_5OmniThinkerForConditionalGeneration``, from a Qwen2_5OmniThinkerConfig)
or the full model with a talker and token2wav (``Qwen2_5OmniForConditionalGeneration``), each
written by ``save_pretrained``, plus the processor's files and the tokenizer.

No weights can be downloaded here: tests and the CPU smoke build one of these instead. The
processor's parts are saved by their own ``save_pretrained`` into the release's layout: one
``preprocessor_config.json`` holding the Whisper feature extractor (300 s window, as released) and
the image processor, ``processor_class`` Qwen2_5OmniProcessor, and ``chat_template.json`` with the
release's template. (``Qwen2_5OmniProcessor`` itself cannot be built where torchvision is missing:
its video processor needs it; west reads only the feature extractor, the tokenizer and the
template.) The tokenizer is a small byte-level BPE (west.models.tiny_llm) with Qwen2.5-Omni's audio
and vision tokens added and named as the processor asks for them (``audio_token`` ...)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from west.models.tiny_llm import build_tokenizer
from west.models.whisper_encoder import hf_part
from west.shapes import AUDIO_TOKENS

DEFAULT_TEXTS = ("hello world", "speech data", "Transcribe the speech.")
# Qwen2.5-Omni-7B's thinker as published (its config.json): a 32-layer Whisper-style audio tower and a
# Qwen2.5-7B; the vocabulary as released. The vision tower stays a toy one: west never reads it.
SHAPE_7B = dict(audio=dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                           n_window=100),
                text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
                          max_position_embeddings=32768, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}))
# the tokens Qwen2_5OmniProcessor reads from its tokenizer by name
NAMED_TOKENS = {"audio_bos_token": AUDIO_TOKENS[0], "audio_token": AUDIO_TOKENS[1], "audio_eos_token": AUDIO_TOKENS[2],
                "vision_bos_token": "<|vision_bos|>", "image_token": "<|IMAGE|>", "vision_eos_token": "<|vision_eos|>",
                "video_token": "<|VIDEO|>"}
# the release's chat template (Qwen/Qwen2.5-Omni-7B, chat_template.json): an audio part is
# <|audio_bos|><|AUDIO|><|audio_eos|>, a default system turn when the conversation has none
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio {{ audio_count.value }}: "
    "{% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(path: str, texts: Iterable[str]):
    from transformers import AutoTokenizer  # heavy

    tok = build_tokenizer(list(texts) * 20, path, vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": list(NAMED_TOKENS.values())},
                           replace_extra_special_tokens=False)
    tok.chat_template = None   # the template is the processor's (chat_template.json), as released
    (Path(path) / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path, extra_special_tokens=NAMED_TOKENS)
    tok.save_pretrained(path)
    return tok


def _processor_files(path: str, n_mels: int, chunk_length: int) -> None:
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor  # heavy

    WhisperFeatureExtractor(feature_size=n_mels, chunk_length=chunk_length).save_pretrained(path)
    pre = Path(path) / "preprocessor_config.json"
    merged = {**Qwen2VLImageProcessorPil().to_dict(), **json.loads(pre.read_text()),
              "processor_class": "Qwen2_5OmniProcessor"}
    pre.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    (Path(path) / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")


def thinker_config(tok, n_mels: int = 80, d_model: int = 32, layers: int = 2, n_window: int = 5,
                   shape: str = "tiny"):
    """A Qwen2_5OmniThinkerConfig for the tokenizer ``tok`` and a one-block vision tower: ``shape`` tiny
    (a ``d_model`` x ``layers`` audio tower attending in chunks of 2 * ``n_window`` mel frames, a
    2-layer LLM) or 7b (:data:`SHAPE_7B`, 128 mel bins)."""
    from transformers import Qwen2_5OmniThinkerConfig  # heavy

    if shape not in ("tiny", "7b"):
        raise ValueError(f"shape {shape!r}: tiny or 7b")
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in NAMED_TOKENS.items()}
    if shape == "7b":
        text, audio = SHAPE_7B["text"], dict(SHAPE_7B["audio"], num_mel_bins=128)
    else:
        text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]})
        audio = dict(d_model=d_model, encoder_layers=layers, encoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
                     num_mel_bins=n_mels, n_window=n_window)
    audio["output_dim"] = text["hidden_size"]
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"],
                  fullatt_block_indexes=[0])
    return Qwen2_5OmniThinkerConfig(
        audio_config=audio, vision_config=vision, text_config=text, audio_token_index=ids["audio_token"],
        image_token_index=ids["image_token"], video_token_index=ids["video_token"],
        audio_start_token_id=ids["audio_bos_token"], audio_end_token_id=ids["audio_eos_token"],
        vision_start_token_id=ids["vision_bos_token"], vision_end_token_id=ids["vision_eos_token"])


def full_config(thinker, vocab: int):
    """A toy Qwen2_5OmniConfig around ``thinker``: a one-layer talker and a tiny token2wav."""
    from transformers import Qwen2_5OmniConfig  # heavy

    ids = {k: getattr(thinker, k) for k in ("audio_token_index", "image_token_index", "video_token_index",
                                            "audio_start_token_id", "audio_end_token_id",
                                            "vision_start_token_id", "vision_end_token_id")}
    talker = dict(vocab_size=vocab, embedding_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]},
                  tts_codec_start_token_id=1, tts_codec_end_token_id=2, tts_codec_pad_token_id=3,
                  tts_codec_mask_token_id=4, tts_text_start_token_id=5, tts_text_end_token_id=6,
                  tts_text_pad_token_id=7, **ids)
    dit = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16, emb_dim=16, enc_emb_dim=16,
               enc_dim=16, enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8, enc_se_channels=8,
               num_embeds=64, mel_dim=16, block_size=4, look_ahead_layers=[0], look_backward_layers=[0])
    bigvgan = dict(mel_dim=16, upsample_initial_channel=32, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
                   resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]])
    return Qwen2_5OmniConfig(thinker_config=thinker.to_dict(), talker_config=talker,
                             token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))


def write_random_qwen2_5_omni(path: str | Path, texts: Iterable[str] = DEFAULT_TEXTS, n_mels: int = 80,
                              d_model: int = 32, layers: int = 2, n_window: int = 5, full: bool = False,
                              chunk_length: int = 300, tower_std: float = 0.2, seed: int = 0, shape: str = "tiny",
                              device: str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """Write a Qwen2.5-Omni to ``path``: its thinker alone, or with ``full`` the whole model (a toy
    talker and token2wav too, rows ``thinker.*`` ...); the thinker's ``shape`` as
    :func:`thinker_config` takes it, drawn on ``device`` in ``dtype``. The audio tower's weights are
    drawn from N(0, ``tower_std``) so that its attention and positions matter (transformers' 0.02
    init leaves it nearly uniform)."""
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniThinkerForConditionalGeneration  # heavy
    from transformers.utils import logging as hf_logging  # heavy

    path = str(path)
    n_mels = 128 if shape == "7b" else n_mels
    tok = _tokenizer(path, texts)
    _processor_files(path, n_mels, chunk_length)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # toy talker ids outside the talker's toy vocabulary: warnings only
    try:
        conf = thinker_config(tok, n_mels, d_model, layers, n_window, shape)
        torch.manual_seed(seed)
        with torch.device(device):
            if full:
                model = Qwen2_5OmniForConditionalGeneration(full_config(conf, len(tok))).to(dtype)
                tower = hf_part(model.thinker)
            else:
                model = Qwen2_5OmniThinkerForConditionalGeneration(conf).to(dtype)
                tower = hf_part(model)
        with torch.no_grad():
            for p in tower.parameters():
                p.normal_(0.0, tower_std)
        model.save_pretrained(path)
    finally:
        hf_logging.set_verbosity(level)
    return path
