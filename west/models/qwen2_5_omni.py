"""Qwen2.5-Omni's thinker (``Qwen2_5OmniThinkerForConditionalGeneration``): its audio tower, run
packed, and its language model, from one directory.

The directory is a full release (``Qwen2_5OmniForConditionalGeneration``: config ``qwen2_5_omni``,
rows ``thinker.*``, ``talker.*``, ``token2wav.*``) or a thinker alone (``qwen2_5_omni_thinker``);
only the thinker's audio tower and language model rows are read from either (the vision tower,
talker and token2wav are left on disk). The language model is west.models.qwen2_5_omni_llm.

The audio tower, as transformers 5.25 runs one utterance (``Qwen2_5OmniAudioEncoder.forward``):
the log-mel is cut into chunks of ``2 * n_window`` frames (2 s; the last chunk is the rest), each
chunk goes through conv1 -> GELU -> conv2 (stride 2) -> GELU reading zeros past its ends, takes
sinusoid positions from 0, and attends only within itself (``cu_seqlens`` over the chunks); the
chunks' frames are then average-pooled in pairs over the whole utterance (an odd last frame
dropped), layer-normed (``ln_post``) and projected (``proj``) to the LLM's width. West forms the
same chunks for every utterance of a batch and runs them all at once: the chunks in Whisper's
zero-gap buffer (west.models.whisper_encoder.packed_convs), their positions from 0, the layers
called unchanged on one packed row with the chunks' boundaries for west's varlen attention, then
each utterance pooled on its own (west.models.qwen2_audio.pool_pairs) and normed. The tower's
``proj`` becomes west's ``linear`` projector at stride 1. Nothing limits the tower's input length;
the processor pads and cuts audio at ``chunk_length`` (300 s in the release), so longer audio is a
counted ``too_long`` skip.

The frame count is Qwen2-Audio's (two stride-2 stages: conv2 and the pooling, over the whole
utterance; a chunk's 2 * n_window frames give n_window conv frames, so chunks never change it),
which is also what the processor counts its ``<|AUDIO|>`` tokens with.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import torch.nn as nn

from west.batch import to_device
from west.models.hf_attention import packed_kwargs, register
from west.models.layout import FrameLayout
from west.models.llm import load_tokenizer
from west.models.qwen2_audio import _FEATURES, QWEN2_AUDIO_STAGES, pool_pairs
from west.models.whisper_encoder import (
    WhisperPackedEncoder,
    check_feature_extractor,
    load_hf_part,
    packed_convs,
    read_hf_config,
    whisper_encoder_frames,
)
from west.schema import ConfigError, require
from west.shapes import AUDIO_TOKENS

# the directories it reads: a full release (thinker + talker + token2wav) and a thinker alone
OMNI_TYPES = ("qwen2_5_omni", "qwen2_5_omni_thinker")
# the thinker's towers: transformers class, config attribute
_PARTS = {"audio_tower": ("Qwen2_5OmniAudioEncoder", "audio_config"),
          "visual": ("Qwen2_5OmniVisionEncoder", "vision_config")}


def thinker_config(conf):
    """The thinker's config of a full release's ``conf`` (its ``thinker_config``), or ``conf`` itself."""
    return conf.thinker_config if conf.model_type == "qwen2_5_omni" else conf


def read_thinker_config(path: str):
    """The Qwen2_5OmniThinkerConfig of the local dir ``path``, or a ConfigError naming model.path."""
    return thinker_config(read_hf_config(path, "model.path", OMNI_TYPES, "a Qwen2.5-Omni directory: "
                                         "Qwen2_5OmniForConditionalGeneration or its thinker alone"))


def check_processor(path: str, conf) -> int:
    """The directory's feature extractor and tokenizer (the parts of its Qwen2_5OmniProcessor that
    audio reads) must be there and match what west feeds the thinker ``conf``: Whisper log-mels of
    its bin count, without dither, and the audio tokens of its config. Returns the processor's
    longest input in mel frames (it pads and cuts audio there)."""
    from transformers import AutoFeatureExtractor  # heavy

    try:
        fe = AutoFeatureExtractor.from_pretrained(path)
        tok = load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: {path!r} has no loadable processor (preprocessor_config.json and "
                          f"tokenizer files, as the release ships them): {e}") from e
    want = {**_FEATURES, "feature_size": int(conf.audio_config.num_mel_bins), "dither": 0.0}
    check_feature_extractor(path, fe, want, "whisper")
    ids = tok.convert_tokens_to_ids(list(AUDIO_TOKENS))
    require(tok.unk_token_id not in ids and None not in ids, "model.path",
            f"{path!r}: the tokenizer lacks Qwen2.5-Omni's audio tokens {AUDIO_TOKENS}")
    config_ids = [conf.audio_start_token_id, conf.audio_token_index, conf.audio_end_token_id]
    require(ids == config_ids, "model.path", f"{path!r}: the tokenizer's {AUDIO_TOKENS} are ids {ids}, config.json "
            f"audio_start_token_id / audio_token_index / audio_end_token_id are {config_ids}")
    return int(fe.nb_max_frames)


@lru_cache(maxsize=8)
def omni_geometry(path: str) -> tuple[int, int, int]:
    """(num_mel_bins, the processor's longest input in mel frames, audio layers) of the dir ``path``."""
    conf = read_thinker_config(path)
    max_frames = check_processor(path, conf)
    audio = conf.audio_config
    return int(audio.num_mel_bins), max_frames, int(audio.encoder_layers)


def load_thinker_part(path: str, part: str, dtype: torch.dtype = torch.float32, **kw) -> nn.Module:
    """The thinker's ``part`` (audio_tower or visual) of a local Qwen2.5-Omni dir: its rows only
    (``thinker.PART.*`` of a full release, ``PART.*`` of a thinker alone) are read."""
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as omni  # heavy

    cls, attr = _PARTS[part]
    return load_hf_part(getattr(omni, cls), path, f"the thinker's {part}", config=getattr(read_thinker_config(path), attr),
                        key_mapping={rf"^(thinker\.)?{part}\.": ""}, dtype=dtype, **kw)


def load_hf_omni_tower(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The thinker's audio tower of a local Qwen2.5-Omni dir, with west's varlen attention registered."""
    return load_thinker_part(path, "audio_tower", dtype, attn_implementation=register())


def chunk_lengths(lens: list[int], chunk: int) -> list[int]:
    """Each utterance's chunks of ``chunk`` mel frames, the last one the rest, in order."""
    return [c for n in lens for c in [chunk] * ((n - 1) // chunk) + [n - chunk * ((n - 1) // chunk)]]


class Qwen2_5OmniPackedEncoder(WhisperPackedEncoder):
    """log-mel feats -> the thinker's normed, pooled audio frames (before ``proj``), packed or padded
    in, flat ``(ΣT'', d_model)`` out; every utterance in its own 2 s chunks, as transformers forms them."""

    encoder_type = "qwen2_5_omni"
    title = "Qwen2.5-Omni audio tower"
    frame_stages = QWEN2_AUDIO_STAGES
    geometry = staticmethod(omni_geometry)
    window_mode = False   # no 30 s window: model.encoder.pad_to_30s is refused

    def __init__(self, hf_encoder: nn.Module, path: str, backend: str = "auto"):
        proj = hf_encoder.proj
        del hf_encoder.proj   # west's linear projector (pretrained_projector) computes it
        super().__init__(hf_encoder, False, backend)
        self.path = path
        self.chunk = 2 * int(hf_encoder.config.n_window)
        if self.chunk // 2 > hf_encoder.positional_embedding.positional_embedding.shape[0]:
            raise ValueError(f"model.path {path!r}: n_window {self.chunk // 2} exceeds the tower's positions")
        self._proj = {"net.weight": proj.weight.detach(), "net.bias": proj.bias.detach()}
        self._max_frames = omni_geometry(path)[1]
        self.hf.audio_bos_eos_token.requires_grad_(False)   # the thinker never reads it: kept for export

    @classmethod
    def from_config(cls, cfg, attn_backend: str = "auto") -> "Qwen2_5OmniPackedEncoder":
        if cfg.pad_to_30s:
            raise ConfigError("model.encoder.pad_to_30s: Qwen2.5-Omni's audio tower has no 30 s window (it reads "
                              "any length in 2 s chunks); leave it out")
        enc = cls(load_hf_omni_tower(cfg.path), cfg.path, attn_backend)
        if cfg.gradient_checkpointing:
            enc.gradient_checkpointing = True
        return enc

    @property
    def max_frames(self) -> int:
        """The processor's window (300 s in the release): it cuts longer audio, west skips it."""
        return self._max_frames

    def pretrained_projector(self) -> Optional[dict[str, torch.Tensor]]:
        """The tower's ``proj`` (d_model -> the LLM's width), as west's LinearProjector names it."""
        return self._proj

    def encode(self, feats: torch.Tensor, lens: list[int], packed: bool) -> tuple[torch.Tensor, FrameLayout]:
        """Checked feats -> the chunks' convolutions, positions and attention, then each utterance pooled."""
        mel = self._packed_mel(feats, lens, packed)
        hf, dev = self.hf, mel.device
        chunks = chunk_lengths(lens, self.chunk)
        conv = [whisper_encoder_frames(n) for n in chunks]
        h = packed_convs(hf.conv1, hf.conv2, mel, chunks, conv)
        positions = to_device(torch.cat([torch.arange(n) for n in conv]), dev)
        h = h + hf.positional_embedding.positional_embedding.index_select(0, positions).to(h.dtype)
        cu = torch.zeros(len(conv) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(conv).cumsum(0)
        kw = packed_kwargs(to_device(cu, dev), max(conv), backend=self.backend, host_cu_seqlens=cu)
        # the layers' own attention splits its input at cu_seqlens and calls the attention function
        # on each piece; given one piece (host boundaries: no sync), west's varlen attention gets the
        # chunks' boundaries in cu_seq_lens_q and keeps every chunk to itself in one call per layer
        whole = torch.tensor([0, int(cu[-1])], dtype=torch.int32)
        for layer in hf.layers:
            h = layer(h, cu_seqlens=whole, **kw)[0]
        h, pooled = pool_pairs(h, [whisper_encoder_frames(n) for n in lens])
        h = hf.ln_post(h)
        return h, FrameLayout(pooled, h.device)
