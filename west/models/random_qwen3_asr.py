"""A randomly initialised Qwen3-ASR directory, as a download would look (config, weights, processor,
tokenizer with the audio tokens, chat template), written by ``save_pretrained`` at toy sizes.

No weights can be downloaded here: the tests and the CPU smoke build one of these instead. The
tokenizer is a small byte-level BPE (west.models.tiny_llm) trained on the given texts, with
Qwen3-ASR's three audio tokens added and named as its processor reads them (``audio_token``,
``audio_bos_token``, ``audio_eos_token``). The chat template renders what the released one renders
for the conversations west builds: a system turn always (empty when none is given), an audio item
as ``<|audio_start|><|audio_pad|><|audio_end|>``, text items as they are, ChatML turns."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from west.models.qwen3_asr import encoder_frames
from west.models.tiny_llm import build_tokenizer
from west.models.whisper_encoder import hf_part

DEFAULT_TEXTS = ("hello world", "speech data", "Transcribe the speech.")
# Qwen3-ASR-1.7B's published shape (its config.json): a 24-layer audio encoder and a Qwen3-1.7B; the
# vocabulary as released (the tokenizer written here is smaller)
SHAPE_1_7B = dict(audio=dict(d_model=1024, encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096,
                             output_dim=2048, downsample_hidden_size=480),
                  text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                            max_position_embeddings=65536, tie_word_embeddings=True))
# the audio tokens of Qwen3-ASR's tokenizer: start, placeholder (one per encoder frame), end
QWEN3_ASR_AUDIO_TOKENS = ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")

CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'audio' or 'audio' in item or 'audio_url' in item %}"
    "{{ '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{ item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


def qwen3_asr_config(tok, n_mels: int = 128, d_model: int = 32, layers: int = 2, n_window: int = 50,
                     n_window_infer: int = 200, shape: str = "tiny"):
    """A Qwen3ASRConfig for the tokenizer ``tok``: ``shape`` tiny (an audio encoder of ``d_model`` x
    ``layers``, a 2-layer Qwen3 with tied embeddings) or 1.7b (:data:`SHAPE_1_7B`)."""
    from transformers import Qwen3ASRConfig  # heavy

    if shape not in ("tiny", "1.7b"):
        raise ValueError(f"shape {shape!r}: tiny or 1.7b")
    if shape == "1.7b":
        audio, text = SHAPE_1_7B["audio"], SHAPE_1_7B["text"]
    else:
        audio = dict(encoder_layers=layers, encoder_attention_heads=4, encoder_ffn_dim=2 * d_model, d_model=d_model,
                     output_dim=32, downsample_hidden_size=8)
        text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                    tie_word_embeddings=True)
    pad, eos = tok.pad_token_id, tok.convert_tokens_to_ids("<|im_end|>")
    return Qwen3ASRConfig(
        audio_config=dict(**audio, num_mel_bins=n_mels, n_window=n_window, n_window_infer=n_window_infer,
                          max_position_embeddings=encoder_frames(2 * n_window, 2 * n_window)),
        text_config=dict(**text, pad_token_id=pad, eos_token_id=eos, bos_token_id=None),
        audio_token_id=tok.convert_tokens_to_ids(QWEN3_ASR_AUDIO_TOKENS[1]), pad_token_id=pad, eos_token_id=eos)


def write_random_qwen3_asr(path: str | Path, texts: Iterable[str] = DEFAULT_TEXTS, n_mels: int = 128,
                           d_model: int = 32, layers: int = 2, n_window: int = 50, n_window_infer: int = 200,
                           tower_std: float = 0.2, seed: int = 0, shape: str = "tiny", device: str = "cpu",
                           dtype: torch.dtype = torch.float32) -> str:
    """Write a ``Qwen3ASRForConditionalGeneration`` to ``path`` with a ``Qwen3ASRProcessor``: ``shape``
    tiny (an audio encoder of ``d_model`` x ``layers``, a 2-layer Qwen3 with tied embeddings) or 1.7b
    (:data:`SHAPE_1_7B`, drawn on ``device`` in ``dtype``). Chunks are ``2 * n_window`` mel frames,
    attention windows ``n_window_infer`` frames (200 puts two chunks in a window, so that short test
    audio spans several windows). The encoder's weights are drawn from N(0, ``tower_std``) so that
    its attention and positions matter."""
    from transformers import (  # heavy
        AutoTokenizer,
        Qwen3ASRFeatureExtractor,
        Qwen3ASRForConditionalGeneration,
        Qwen3ASRProcessor,
    )

    path = str(path)
    build_tokenizer(list(texts) * 20, path, vocab_size=300)
    named = dict(zip(("audio_bos_token", "audio_token", "audio_eos_token"), QWEN3_ASR_AUDIO_TOKENS))
    tok = AutoTokenizer.from_pretrained(path, extra_special_tokens=named)
    tok.add_special_tokens({"additional_special_tokens": list(QWEN3_ASR_AUDIO_TOKENS)},
                           replace_extra_special_tokens=False)
    fe = Qwen3ASRFeatureExtractor(feature_size=n_mels, n_window=n_window)
    Qwen3ASRProcessor(fe, tok, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    conf = qwen3_asr_config(tok, n_mels, d_model, layers, n_window, n_window_infer, shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ASRForConditionalGeneration(conf).to(dtype)
    with torch.no_grad():
        for name, p in hf_part(model).named_parameters():
            if "positional_embedding" not in name:
                p.normal_(0.0, tower_std)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = conf.eos_token_id, conf.pad_token_id
    model.save_pretrained(path)
    return path
