"""Qwen2-Audio's audio tower (``Qwen2AudioForConditionalGeneration.audio_tower``), run packed.

The tower is a Whisper encoder whose output is average-pooled in pairs of frames and then
layer-normed (transformers' ``Qwen2AudioEncoder.forward``: conv1 -> GELU -> conv2 -> GELU ->
+ positions -> layers -> AvgPool1d(2, 2) -> layer_norm). It reuses WhisperPackedEncoder's
packed layout (per-utterance convolutions, positions from 0, per-utterance attention) and
pools each utterance on its own: frames 2j and 2j+1 of one utterance, an odd last frame
dropped as AvgPool1d drops it, never a pair across two utterances. The released model's
projector (``multi_modal_projector.linear``) becomes west's ``linear`` projector at stride 1,
and its language model is read from the same directory (west.models.llm.load_llm).

``pad_to_30s`` runs transformers' own tower on each utterance padded to 3000 frames, the way
the model was pretrained and the way ``Qwen2AudioForConditionalGeneration`` runs it (padded
frames masked out of the attention; the convolutions see the padding).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from west.batch import to_device
from west.models.hf_attention import register
from west.models.whisper_encoder import (
    WHISPER_STAGES,
    WhisperPackedEncoder,
    load_hf_part,
    read_hf_config,
    read_processor,
)
from west.schema import require
from west.shapes import AUDIO_TOKENS, frames_after

QWEN2_AUDIO_STAGES = (*WHISPER_STAGES, (2, 2, 0))   # + AvgPool1d(kernel 2, stride 2)
_TOWER_KEYS = {r"^audio_tower\.": ""}
PROJECTOR_PREFIX = "multi_modal_projector.linear."


def read_qwen2_audio_config(path: str):
    """The Qwen2AudioConfig of a local directory, or a ConfigError naming model.path."""
    return read_hf_config(path, "model.path", "qwen2_audio", "a Qwen2AudioForConditionalGeneration directory")


# what west's whisper feature stage computes (west.data.whisper_features): the processor must agree
_FEATURES = {"sampling_rate": 16000, "hop_length": 160, "n_fft": 400}


def check_processor(path: str, conf) -> None:
    """The directory's processor (feature extractor + tokenizer) must be there and match what west
    feeds the model: Whisper log-mels of the model's bin count, and the audio tokens of its config."""
    want = {**_FEATURES, "feature_size": int(conf.audio_config.num_mel_bins)}
    tok = read_processor(path, "Qwen2-Audio", want, "whisper").tokenizer
    ids = tok.convert_tokens_to_ids(list(AUDIO_TOKENS))
    require(tok.unk_token_id not in ids and None not in ids, "model.path",
            f"{path!r}: the tokenizer lacks Qwen2-Audio's audio tokens {AUDIO_TOKENS}")
    require(ids[1] == conf.audio_token_index, "model.path", f"{path!r}: the tokenizer's <|AUDIO|> is id {ids[1]}, "
            f"config.json audio_token_index is {conf.audio_token_index}")


@lru_cache(maxsize=8)
def qwen2_audio_geometry(path: str) -> tuple[int, int, int]:
    """(num_mel_bins, max mel frames, audio layers) of the Qwen2-Audio dir ``path`` (its processor checked)."""
    conf = read_qwen2_audio_config(path)
    check_processor(path, conf)
    audio = conf.audio_config
    return int(audio.num_mel_bins), 2 * int(audio.max_source_positions), int(audio.encoder_layers)


def load_hf_qwen2_audio_tower(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The audio tower of a local Qwen2-Audio directory, with west's varlen attention registered."""
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder  # heavy

    return load_hf_part(Qwen2AudioEncoder, path, "audio tower", config=read_qwen2_audio_config(path).audio_config,
                        key_mapping=_TOWER_KEYS, attn_implementation=register(), dtype=dtype)


class Qwen2AudioPackedEncoder(WhisperPackedEncoder):
    """log-mel feats -> pooled audio-tower frames, packed or padded in, flat ``(ΣT'', d_model)`` out."""

    def __init__(self, hf_encoder: nn.Module, path: str, pad_to_30s: bool = False, backend: str = "auto"):
        super().__init__(hf_encoder, pad_to_30s, backend)
        self.path = path

    encoder_type = "qwen2_audio"
    title = "Qwen2-Audio audio tower"
    frame_stages = QWEN2_AUDIO_STAGES
    geometry = staticmethod(qwen2_audio_geometry)

    @classmethod
    def from_config(cls, cfg, attn_backend: str = "auto") -> "Qwen2AudioPackedEncoder":
        enc = cls(load_hf_qwen2_audio_tower(cfg.path), cfg.path, cfg.pad_to_30s, attn_backend)
        if cfg.gradient_checkpointing:
            enc.gradient_checkpointing = True
        return enc

    def pretrained_projector(self) -> Optional[dict[str, torch.Tensor]]:
        """``multi_modal_projector.linear`` of the released model, as west's LinearProjector names it."""
        from safetensors import safe_open  # heavy

        root = Path(self.path)
        index = root / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else ["model.safetensors"]
        out = {}
        for name in files:
            with safe_open(str(root / name), framework="pt") as f:
                for key in f.keys():
                    if key.startswith(PROJECTOR_PREFIX):
                        out["net." + key[len(PROJECTOR_PREFIX):]] = f.get_tensor(key)
        if set(out) != {"net.weight", "net.bias"}:
            raise ValueError(f"model.path {self.path!r}: no multi_modal_projector.linear weights found")
        return out

    def _head(self, h: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Per-utterance mean of frame pairs (AvgPool1d(2, 2)), then the tower's final norm."""
        h, pooled = pool_pairs(h, lens)
        return self.hf.layer_norm(h), pooled

    def _stock(self, batch: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """transformers' tower on (N, n_mels, 3000) as Qwen2AudioForConditionalGeneration runs it: the
        conv frames past each utterance masked out of the attention (``lens``: conv frames)."""
        from transformers.masking_utils import create_bidirectional_mask  # heavy

        n, width = batch.shape[0], batch.shape[-1] // 2
        keep = (torch.arange(width)[None] < torch.tensor(lens)[:, None]).long()
        mask = create_bidirectional_mask(config=self.hf.config, inputs_embeds=batch.new_zeros(n, width, 1),
                                         attention_mask=to_device(keep, batch.device))
        return self.hf(input_features=batch, attention_mask=mask).last_hidden_state, [t // 2 for t in lens]


def pool_pairs(h: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Flat rows ``(ΣT, D)`` of utterances of ``lens`` frames -> the mean of frames 2j and 2j+1 of each
    utterance (AvgPool1d(2, 2) per utterance: an odd last frame dropped, no pair across two), and
    the pooled lengths."""
    pooled = [n // 2 for n in lens]
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    first = torch.cat([starts[i] + 2 * torch.arange(p) for i, p in enumerate(pooled)])
    first = to_device(first, h.device)
    return (h.index_select(0, first) + h.index_select(0, first + 1)) / 2, pooled


def tower_frames(n_frames: int) -> int:
    """Pooled audio-tower frames for ``n_frames`` log-mel frames (0: too short to give one)."""
    return frames_after(QWEN2_AUDIO_STAGES, n_frames)
