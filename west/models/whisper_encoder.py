"""Hugging Face's own WhisperEncoder, run packed: no 30 s padding, nothing crosses an utterance.

The weights and layers are transformers' (``WhisperEncoder.from_pretrained``); west only
changes how a batch is laid out around them, following ``WhisperEncoder.forward``'s order
(transformers 5.23): conv1 -> GELU -> conv2 -> GELU -> + embed_positions -> dropout ->
layers -> layer_norm.

* Convolutions: every utterance sits in a zero-gap buffer at an even offset with >= 1 zero
  frame after it, the conv1+GELU output is re-zeroed on the gaps before conv2 (stride 2),
  so each frame sees exactly its own utterance's zero padding.
* Positions: utterance frames take rows 0..T'-1 of ``embed_positions``.
* Attention: the layers are called unchanged on one packed row; they forward keyword
  arguments to the attention function, and with ``attn_implementation="west_varlen"``
  (west.models.hf_attention) ``cu_seq_lens_q`` makes it attend within each utterance.

``pad_to_30s=True`` runs the stock padded encoder instead (what users run today) and keeps
each utterance's first T' output rows.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from west.batch import to_device
from west.models.hf_attention import ATTN_NAME, packed_kwargs, register
from west.models.layout import FlatEncoder, FrameLayout
from west.models.llm import hf_checkpointing
from west.schema import ConfigError, require
from west.shapes import SpeechShape, frames_after

# Rows of a Whisper checkpoint that belong to the encoder, by the class that saved it.
_KEY_MAPPING = {r"^model\.encoder\.": "", r"^encoder\.": ""}
# conv1 (k3, s1, p1) keeps T, conv2 (k3, s2, p1) gives (T - 1) // 2 + 1 (0 for T = 0)
WHISPER_STAGES = ((3, 1, 1), (3, 2, 1))


def whisper_encoder_frames(n_frames: int) -> int:
    """Whisper encoder frames for ``n_frames`` log-mel frames."""
    return frames_after(WHISPER_STAGES, n_frames)


def read_hf_config(path: str, key: str, model_type: str | tuple[str, ...], what: str):
    """The Hugging Face config of the local directory ``path`` (config key ``key``), checked to be a
    ``model_type`` (or one of several; ``what`` says where that type comes from), or a ConfigError naming ``key``."""
    from transformers import AutoConfig  # heavy

    require(path and Path(path).is_dir(), key, f"{path!r} is not a directory")
    try:
        conf = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path!r} is not a Hugging Face model directory: {e}") from e
    types = (model_type,) if isinstance(model_type, str) else model_type
    require(conf.model_type in types, key, f"{path!r} has config.json model_type={conf.model_type!r}, "
            f"expected {model_type!r} ({what})")
    return conf


def read_processor(path: str, title: str, want: dict, features: str):
    """The processor (feature extractor + tokenizer) of the released model's dir ``path`` (model.path),
    its feature extractor's settings checked against ``want``, what west's ``data.features``
    ``features`` computes; a ConfigError naming model.path and the setting otherwise."""
    from transformers import AutoProcessor  # heavy

    try:
        proc = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: {path!r} has no loadable processor "
                          f"(processor_config.json or preprocessor_config.json + tokenizer files): {e}") from e
    fe, tok = getattr(proc, "feature_extractor", None), getattr(proc, "tokenizer", None)
    require(fe is not None and tok is not None, "model.path", f"{path!r}: no {title} processor (feature "
            "extractor and tokenizer); copy processor_config.json / preprocessor_config.json from the release")
    check_feature_extractor(path, fe, want, features)
    return proc


def check_feature_extractor(path: str, fe, want: dict, features: str) -> None:
    """Each setting of ``want`` on the feature extractor ``fe`` of the dir ``path`` (model.path), what
    west's ``data.features`` ``features`` computes; a ConfigError naming model.path and the setting."""
    for key, value in want.items():
        require(getattr(fe, key, None) == value, "model.path", f"{path!r}: feature extractor {key}="
                f"{getattr(fe, key, None)!r}, west's {features} features need {value!r}")


def read_whisper_config(path: str):
    """The HF config of a local Whisper directory, or a ConfigError naming model.encoder.path."""
    return read_hf_config(path, "model.encoder.path", "whisper", "model.encoder.type whisper")


def whisper_max_frames(conf) -> int:
    """Mel frames in Whisper's window (3000 = 30 s): max_source_positions times conv2's stride 2."""
    return 2 * int(conf.max_source_positions)


@lru_cache(maxsize=8)
def whisper_geometry(path: str) -> tuple[int, int, int]:
    """(num_mel_bins, max mel frames, encoder layers) of the Whisper dir ``path``, read once per path."""
    conf = read_whisper_config(path)
    return int(conf.num_mel_bins), whisper_max_frames(conf), int(conf.encoder_layers)


def hf_part(hf_model: nn.Module, name: str = "audio_tower") -> nn.Module:
    """A part (``audio_tower``, ``visual``) of a released speech LLM's transformers model or thinker:
    ``model.NAME`` since transformers 5.2x, ``NAME`` on the model itself in the 5.17 the GPU machines run."""
    inner = getattr(hf_model, "model", None)
    return getattr(inner, name) if inner is not None and hasattr(inner, name) else getattr(hf_model, name)


def load_hf_part(cls, path: str, what: str, key: str = "model.path", **kw) -> nn.Module:
    """``cls.from_pretrained(path, **kw)`` for one part of a released directory: the rows of its
    other parts are "unexpected" by design (not logged); a row of this part missing is an error
    naming ``key`` and ``what`` the part is."""
    from transformers.utils import logging as hf_logging  # heavy

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        module, info = cls.from_pretrained(path, output_loading_info=True, **kw)
    finally:
        hf_logging.set_verbosity(level)
    missing = sorted(info["missing_keys"])
    if missing:
        raise ValueError(f"{key} {path!r}: the checkpoint lacks {what} weights {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return module


def load_hf_whisper_encoder(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The encoder half of a local Whisper directory, with west's varlen attention registered."""
    from transformers.models.whisper.modeling_whisper import WhisperEncoder  # heavy

    read_whisper_config(path)
    return load_hf_part(WhisperEncoder, path, "the Whisper encoder's", key="model.encoder.path",
                        key_mapping=_KEY_MAPPING, attn_implementation=register(), dtype=dtype)


def packed_convs(conv1: nn.Conv1d, conv2: nn.Conv1d, mel: torch.Tensor, lens: list[int],
                 out_lens: list[int]) -> torch.Tensor:
    """Whisper's front end, conv1 -> GELU -> conv2 (stride 2) -> GELU, on packed mel ``(ΣT, n_mels)``
    of segments of ``lens`` frames, each as if alone: ``(ΣT', D)`` rows, ``out_lens`` per segment.

    Every segment sits in a zero-gap buffer at an even offset with >= 1 zero frame after it, and
    conv1's output is re-zeroed on the gaps before conv2, so each frame sees exactly its own
    segment's zero padding."""
    dev = mel.device
    # Zero-gap buffer: segment i at even offset s_i, slot width round_up_even(T_i + 1).
    widths = torch.tensor([n + 1 + (n + 1) % 2 for n in lens])
    starts = torch.cumsum(widths, 0) - widths
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    first = torch.repeat_interleave(torch.tensor([0] + lens[:-1]).cumsum(0), torch.tensor(lens))
    in_rows = to_device(starts[seg] + torch.arange(sum(lens)) - first, dev)
    out_seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(out_lens))
    positions = torch.cat([torch.arange(n) for n in out_lens])
    out_rows = to_device(starts[out_seg] // 2 + positions, dev)

    buf = mel.new_zeros(int(widths.sum()), mel.shape[1]).index_copy(0, in_rows, mel)
    keep = torch.zeros(buf.shape[0], 1, dtype=mel.dtype, device=dev).index_fill(0, in_rows, 1.0)
    h = F.gelu(conv1(buf.t()[None]))          # (1, D, L)
    h = F.gelu(conv2(h * keep.t()[None]))     # gaps re-zeroed: conv2 sees per-segment zero padding
    return h[0].t().index_select(0, out_rows)


class HFTower(FlatEncoder):
    """A FlatEncoder around a transformers audio tower ``self.hf`` whose ``layers`` are its blocks (FSDP's
    units): its widths from its config, freezing its front (the modules named in ``front``) with the
    first layers, and transformers' own activation checkpointing (its positions are fixed or never
    trained here)."""

    front: tuple[str, ...] = ()
    title = "audio encoder"

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.hf.layers)

    @property
    def output_dim(self) -> int:
        return self.hf.config.d_model

    @property
    def num_mel_bins(self) -> int:
        return self.hf.config.num_mel_bins

    def freeze_blocks(self, n: int) -> None:
        """Freeze the front and the first ``n`` layers."""
        if n > len(self.hf.layers):
            raise ValueError(f"model.freeze_encoder_blocks {n} > the {self.title}'s {len(self.hf.layers)} layers")
        if n > 0:
            for m in (*(getattr(self.hf, name) for name in self.front), *self.hf.layers[:n]):
                m.requires_grad_(False)

    @property
    def gradient_checkpointing(self) -> bool:
        return bool(getattr(self.hf, "gradient_checkpointing", False))

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        hf_checkpointing(self.hf, on)


class WhisperPackedEncoder(HFTower):
    """log-mel feats -> encoder frames, packed ``(ΣT, n_mels)+cu_seqlens`` or padded ``(N, T, n_mels)+lengths``.

    Output is always flat ``(ΣT', d_model)`` in utterance order (a packed FrameLayout)."""

    def __init__(self, hf_encoder: nn.Module, pad_to_30s: bool = False, backend: str = "auto"):
        super().__init__()
        if getattr(hf_encoder.config, "_attn_implementation", None) != ATTN_NAME and not pad_to_30s:
            raise ValueError(f"packed Whisper needs the encoder loaded with attn_implementation={ATTN_NAME!r}")
        self.hf = hf_encoder
        # Whisper's positions are fixed sinusoids: WhisperEncoder.__init__ freezes them, but
        # from_pretrained (transformers 5.23) hands them back trainable; freeze them again.
        positions = getattr(self.hf, "embed_positions", None)   # a subclass's tower may hold them as a buffer
        if positions is not None:
            positions.requires_grad_(False)
        self.pad_to_30s = pad_to_30s
        self.backend = backend

    packs_padded_input = True   # padded feats are packed before the convolutions
    window_mode = True          # pad_to_30s: the stock encoder on its 30 s window

    @classmethod
    def from_pretrained(cls, path: str, pad_to_30s: bool = False, backend: str = "auto",
                        dtype: torch.dtype = torch.float32) -> "WhisperPackedEncoder":
        return cls(load_hf_whisper_encoder(path, dtype), pad_to_30s, backend)

    @classmethod
    def from_config(cls, cfg, attn_backend: str = "auto") -> "WhisperPackedEncoder":
        """The encoder of the Whisper dir ``model.encoder.path``, run packed (or padded with ``pad_to_30s``)."""
        enc = cls.from_pretrained(cfg.path, pad_to_30s=cfg.pad_to_30s, backend=attn_backend)
        if cfg.gradient_checkpointing:
            enc.gradient_checkpointing = True
        return enc

    # what a Whisper-like tower's checkpoint and convolutions give (a subclass names its own)
    encoder_type = "whisper"
    front = ("conv1", "conv2")
    title = "Whisper encoder"
    frame_stages = WHISPER_STAGES
    geometry = staticmethod(whisper_geometry)   # path -> (num_mel_bins, max mel frames, layers)

    @classmethod
    def speech_shape(cls, cfg, projector_stride: int) -> SpeechShape:
        n_mels, max_frames, _ = cls.geometry(cfg.path)
        return SpeechShape(projector_stride=projector_stride, encoder_type=cls.encoder_type, max_frames=max_frames,
                           num_mel_bins=n_mels, frame_stages=cls.frame_stages, features="whisper")

    @classmethod
    def num_layers(cls, cfg) -> int:
        return cls.geometry(cfg.path)[2]

    @property
    def max_frames(self) -> int:
        """Mel frames in Whisper's window (3000 = 30 s): longer utterances are refused."""
        return self.hf.config.max_source_positions * self.hf.conv1.stride[0] * self.hf.conv2.stride[0]

    # ------------------------------------------------------------------ forward
    def encode(self, feats: torch.Tensor, lens: list[int], packed: bool) -> tuple[torch.Tensor, FrameLayout]:
        """Checked feats (FlatEncoder.forward_flat) -> flat rows ``(ΣT', D)`` and their (packed) layout."""
        mel = self._packed_mel(feats, lens, packed)
        conv_lens = [whisper_encoder_frames(n) for n in lens]
        run = self._forward_padded_30s if self.pad_to_30s else self._forward_packed
        x, out_lens = run(mel, lens, conv_lens)
        return x, FrameLayout(out_lens, x.device)

    def _packed_mel(self, feats: torch.Tensor, lens: list[int], packed: bool) -> torch.Tensor:
        if feats.shape[-1] != self.num_mel_bins:
            raise ValueError(f"Whisper expects {self.num_mel_bins} mel bins (its config), feats have {feats.shape[-1]}")
        if not packed:   # the real frames of every row, in order (indices built on the host)
            rows = torch.cat([i * feats.shape[1] + torch.arange(n) for i, n in enumerate(lens)])
            feats = feats.reshape(-1, feats.shape[-1]).index_select(0, to_device(rows, feats.device))
        too_long = [i for i, n in enumerate(lens) if n > self.max_frames]
        if too_long:
            raise ValueError(
                f"utterances {too_long} have {[lens[i] for i in too_long]} mel frames, more than the encoder's "
                f"{self.max_frames}-frame ({self.max_frames // 100} s) window; the data pipeline must skip them "
                "(counted), never truncate")
        if any(n < 1 for n in lens):
            raise ValueError(f"every utterance needs >= 1 mel frame, got lengths {lens}")
        return feats

    def _forward_packed(self, mel: torch.Tensor, lens: list[int],
                        out_lens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Packed mel -> (the rows of :meth:`_head`, their lengths); ``out_lens``: frames after conv2."""
        hf, dev = self.hf, mel.device
        h = packed_convs(hf.conv1, hf.conv2, mel, lens, out_lens)
        positions = torch.cat([torch.arange(n) for n in out_lens])
        h = h + hf.embed_positions(to_device(positions, dev))
        h = F.dropout(h, p=hf.dropout, training=self.training)[None]

        cu = torch.zeros(len(out_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(out_lens).cumsum(0)
        kw = packed_kwargs(to_device(cu, dev), max(out_lens), backend=self.backend, host_cu_seqlens=cu)
        for layer in hf.layers:
            if self.training and hf.layerdrop > 0.0 and torch.rand([]) < hf.layerdrop:
                continue
            h = layer(h, None, **kw)
        return self._head(h[0], out_lens)

    def _head(self, h: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The layers' packed output (ΣT', D) -> the encoder's output rows and lengths (Whisper: its final norm)."""
        return self.hf.layer_norm(h), lens

    def _stock(self, batch: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Transformers' own forward on (N, n_mels, 3000) -> ((N, L, D), each utterance's first rows to keep)."""
        return self.hf(input_features=batch).last_hidden_state, lens

    def _forward_padded_30s(self, mel: torch.Tensor, lens: list[int],
                            out_lens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Stock path: each utterance padded to the 30 s window with the value the feature
        extractor gives silence (the utterance's floor, max(feat) - 2, never below -1.5)."""
        full, n, dev = self.max_frames, len(lens), mel.device
        seg = to_device(torch.repeat_interleave(torch.arange(n), torch.tensor(lens)), dev)
        floor = mel.new_zeros(n).scatter_reduce(0, seg, mel.amax(1), "amax", include_self=False)
        fill = (floor - 2.0).clamp(min=-1.5)                   # per utterance, on the device
        rows = torch.cat([i * full + torch.arange(t) for i, t in enumerate(lens)])
        batch = fill[:, None, None].expand(n, full, mel.shape[1]).reshape(n * full, -1)
        batch = batch.index_copy(0, to_device(rows, dev), mel).view(n, full, -1).transpose(1, 2)
        y, out_lens = self._stock(batch, out_lens)   # (N, 1500, D)
        keep = torch.cat([i * y.shape[1] + torch.arange(t) for i, t in enumerate(out_lens)])
        return y.reshape(-1, y.shape[-1]).index_select(0, to_device(keep, dev)), out_lens


__all__ = ["WhisperPackedEncoder", "load_hf_part", "load_hf_whisper_encoder", "packed_convs", "read_whisper_config",
           "whisper_encoder_frames", "whisper_max_frames"]
