"""A randomly initialised Qwen2-Audio directory, as a download would look (config, weights,
processor, tokenizer with the audio tokens), written by ``save_pretrained`` at toy sizes.

No weights can be downloaded here: tests, the CPU smoke and tools/qwen2_audio_padding.py build
one of these instead. The tokenizer is a small byte-level BPE (west.models.tiny_llm) trained on
the given texts, with Qwen2-Audio's three audio tokens added."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from west.models.tiny_llm import build_tokenizer
from west.models.whisper_encoder import hf_part
from west.shapes import AUDIO_PLACEHOLDER, AUDIO_TOKENS

DEFAULT_TEXTS = ("hello world", "speech data", "Transcribe the speech.")


# Qwen2-Audio-7B's published shape (Qwen/Qwen2-Audio-7B-Instruct config.json): a Whisper-large-v3
# tower and a Qwen2-7B; the vocabulary as released (the tokenizer written here is smaller).
SHAPE_7B = dict(audio=dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120),
                text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                          num_key_value_heads=4, vocab_size=156032, rms_norm_eps=1e-5,
                          max_position_embeddings=8192, tie_word_embeddings=False))


def qwen2_audio_config(tok, n_mels: int = 80, d_model: int = 32, layers: int = 2, shape: str = "tiny"):
    """A Qwen2AudioConfig for the tokenizer ``tok``: ``shape`` tiny (an audio tower of ``d_model`` x
    ``layers``, a 2-layer Qwen2) or 7b (:data:`SHAPE_7B`, 128 mel bins)."""
    from transformers import Qwen2AudioConfig  # heavy

    if shape not in ("tiny", "7b"):
        raise ValueError(f"shape {shape!r}: tiny or 7b")
    if shape == "7b":
        n_mels, audio, text = 128, SHAPE_7B["audio"], SHAPE_7B["text"]
    else:
        audio = dict(d_model=d_model, encoder_layers=layers, encoder_attention_heads=4, encoder_ffn_dim=2 * d_model)
        text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    return Qwen2AudioConfig(
        audio_config=dict(**audio, num_mel_bins=n_mels, max_source_positions=1500, dropout=0.0),
        text_config=dict(model_type="qwen2", **text),
        audio_token_index=tok.convert_tokens_to_ids(AUDIO_PLACEHOLDER))


def write_random_qwen2_audio(path: str | Path, texts: Iterable[str] = DEFAULT_TEXTS, n_mels: int = 80,
                             d_model: int = 32, layers: int = 2, tower_std: float = 0.2, seed: int = 0,
                             shape: str = "tiny", device: str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """Write a ``Qwen2AudioForConditionalGeneration`` to ``path``: ``shape`` tiny (audio tower
    ``d_model`` x ``layers``, a 2-layer Qwen2), or 7b (:data:`SHAPE_7B`, 128 mel bins; drawn on
    ``device`` in ``dtype``: a GPU draws its 8.4 B weights in seconds). The tower's weights are drawn
    from N(0, ``tower_std``) so that its attention and positions matter (transformers' 0.02 init
    leaves it nearly uniform)."""
    from transformers import (  # heavy
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    path = str(path)
    tok = build_tokenizer(list(texts) * 20, path, vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": list(AUDIO_TOKENS)})
    conf = qwen2_audio_config(tok, n_mels, d_model, layers, shape)
    Qwen2AudioProcessor(WhisperFeatureExtractor(feature_size=conf.audio_config.num_mel_bins), tok).save_pretrained(path)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2AudioForConditionalGeneration(conf).to(dtype)
    with torch.no_grad():
        for p in hf_part(model).parameters():
            p.normal_(0.0, tower_std)
    model.save_pretrained(path)
    return path
