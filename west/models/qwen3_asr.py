"""Qwen3-ASR's audio encoder (``Qwen3ASRForConditionalGeneration.model.audio_tower``), run packed.

transformers' ``Qwen3ASREncoder.forward`` (5.25) on one utterance of T mel frames: the mel is
zero-padded to whole chunks of ``2 * n_window`` frames (100); each chunk runs alone through three
Conv2d (k3, s2, p1 over frequency and time) + GELU, ``conv_out`` and the sinusoidal positions
0..12 of its own frames; the frames each chunk's real mel frames give are kept (13 per full
chunk), then the layers attend inside windows of ``n_window_infer // (2 * n_window)`` full chunks
(104 frames), the last window the remainder (an utterance under one chunk: one window), and
``ln_post`` ends it. Here every utterance of a batch is cut into its own chunks the same way (one
convolution call over all chunks of all utterances), and the windows of every utterance are the
``cu_seqlens`` of west's varlen attention (west.models.hf_attention): a frame sees only its own
window of its own utterance, exactly as when the utterance runs alone. The layers are transformers' own; the data side reserves
``SpeechShape.slots`` (west.shapes.chunked_frames) placeholder tokens, the processor's count.

The released projector (``multi_modal_projector``: Linear, GELU, Linear) becomes west's ``mlp``
projector at stride 1, its hidden width the encoder's ``d_model``; the Qwen3 language model is read
from the same directory (west.models.llm.load_llm). Features: ``data.features qwen3_asr``
(west.data.qwen3_asr_features), checked here against the directory's processor.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from west.batch import to_device
from west.models.hf_attention import ATTN_NAME, packed_kwargs, register
from west.models.layout import FrameLayout
from west.models.whisper_encoder import HFTower, load_hf_part, read_hf_config, read_processor
from west.schema import ConfigError, require
from west.shapes import SpeechShape, chunked_frames

CONV_STAGES = ((3, 2, 1),) * 3          # conv2d1..3 along time: (kernel, stride, padding)
MAX_FRAMES = 120000                     # 1200 s: the longest input of Qwen3-ASR's own inference package
_TOWER_KEYS = {r"^model\.audio_tower\.": "", r"^audio_tower\.": ""}
PROJECTOR_PREFIX = "model.multi_modal_projector."
# what west's qwen3_asr feature stage computes (west.data.qwen3_asr_features): the processor must agree
_FEATURES = {"sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "min_length": 8000, "dither": 0.0}


def read_qwen3_asr_config(path: str):
    """The Qwen3ASRConfig of a local directory, or a ConfigError naming model.path."""
    return read_hf_config(path, "model.path", "qwen3_asr", "a Qwen3ASRForConditionalGeneration directory")


@lru_cache(maxsize=8)
def qwen3_asr_geometry(path: str) -> tuple[int, int, int, tuple[str, str, str]]:
    """(num_mel_bins, chunk frames, audio layers, (audio start, placeholder, end) tokens) of the
    Qwen3-ASR dir ``path``, its processor checked against west's features and its config."""
    conf = read_qwen3_asr_config(path)
    audio = conf.audio_config
    chunk = 2 * int(audio.n_window)
    require(chunk > 0 and audio.n_window_infer % chunk == 0 and audio.n_window_infer >= chunk, "model.path",
            f"{path!r}: audio_config n_window_infer={audio.n_window_infer} must be a positive multiple of "
            f"2 * n_window = {chunk} (its attention windows are whole chunks)")
    require(audio.max_position_embeddings >= chunked_frames(CONV_STAGES, chunk, chunk), "model.path",
            f"{path!r}: audio_config max_position_embeddings={audio.max_position_embeddings} < the "
            f"{chunked_frames(CONV_STAGES, chunk, chunk)} frames of one chunk")
    want = {**_FEATURES, "feature_size": int(audio.num_mel_bins), "n_window": int(audio.n_window)}
    proc = read_processor(path, "Qwen3-ASR", want, "qwen3_asr")
    tokens = tuple(getattr(proc, f"audio_{k}token", None) for k in ("bos_", "", "eos_"))
    ids = proc.tokenizer.convert_tokens_to_ids([t for t in tokens if t])
    require(None not in tokens and proc.tokenizer.unk_token_id not in ids and None not in ids, "model.path",
            f"{path!r}: the tokenizer does not name Qwen3-ASR's audio tokens (audio_bos_token, audio_token, "
            f"audio_eos_token in tokenizer_config.json): got {tokens}")
    require(ids[1] == conf.audio_token_id, "model.path", f"{path!r}: the tokenizer's {tokens[1]} is id {ids[1]}, "
            f"config.json audio_token_id is {conf.audio_token_id}")
    return int(audio.num_mel_bins), chunk, int(audio.encoder_layers), tokens


def load_hf_qwen3_asr_encoder(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The audio encoder of a local Qwen3-ASR directory, with west's varlen attention registered."""
    from transformers.models.qwen3_asr.modeling_qwen3_asr import Qwen3ASREncoder  # heavy

    return load_hf_part(Qwen3ASREncoder, path, "audio encoder", config=read_qwen3_asr_config(path).audio_config,
                        key_mapping=_TOWER_KEYS, attn_implementation=register(), dtype=dtype)


class Qwen3ASRPackedEncoder(HFTower):
    """log-mel feats -> audio-encoder frames, packed ``(ΣT, n_mels)+cu_seqlens`` or padded ``(N, T,
    n_mels)+lengths`` in, flat ``(ΣT', d_model)`` out in utterance order."""

    encoder_type = "qwen3_asr"
    front = ("conv2d1", "conv2d2", "conv2d3", "conv_out")
    title = "Qwen3-ASR encoder"
    packs_padded_input = True   # padded feats are packed before the convolutions

    def __init__(self, hf_encoder: nn.Module, path: str, backend: str = "auto"):
        super().__init__()
        if getattr(hf_encoder.config, "_attn_implementation", None) != ATTN_NAME:
            raise ValueError(f"packed Qwen3-ASR needs the encoder loaded with attn_implementation={ATTN_NAME!r}")
        self.hf = hf_encoder
        self.path = path
        self.backend = backend
        conf = hf_encoder.config
        self.chunk = 2 * int(conf.n_window)
        # frames per attention window: whole chunks' worth (transformers' window_aftercnn)
        self.window = chunked_frames(CONV_STAGES, self.chunk, self.chunk) * (conf.n_window_infer // self.chunk)

    @classmethod
    def from_config(cls, cfg, attn_backend: str = "auto") -> "Qwen3ASRPackedEncoder":
        if cfg.pad_to_30s:
            raise ConfigError("model.encoder.pad_to_30s: Qwen3-ASR has no 30 s window (its processor pads "
                              "each utterance to whole 1 s chunks only, as west does); leave it out")
        qwen3_asr_geometry(cfg.path)
        enc = cls(load_hf_qwen3_asr_encoder(cfg.path), cfg.path, attn_backend)
        if cfg.gradient_checkpointing:
            enc.gradient_checkpointing = True
        return enc

    @classmethod
    def speech_shape(cls, cfg, projector_stride: int) -> SpeechShape:
        n_mels, chunk, _, tokens = qwen3_asr_geometry(cfg.path)
        return SpeechShape(projector_stride=projector_stride, encoder_type=cls.encoder_type, max_frames=MAX_FRAMES,
                           num_mel_bins=n_mels, frame_stages=CONV_STAGES, chunk_frames=chunk, features="qwen3_asr",
                           audio_tokens=tokens)

    @classmethod
    def num_layers(cls, cfg) -> int:
        return qwen3_asr_geometry(cfg.path)[2]

    @classmethod
    def release_projector(cls, path: str) -> dict:
        """The released projector is Linear(d_model, d_model), GELU, Linear(d_model, output_dim)."""
        return {"type": "mlp", "stride": 1, "hidden_dim": int(read_qwen3_asr_config(path).audio_config.d_model)}

    def pretrained_projector(self) -> Optional[dict[str, torch.Tensor]]:
        """``multi_modal_projector.linear_1`` / ``linear_2``, as west's mlp Projector names them."""
        from safetensors import safe_open  # heavy

        root = Path(self.path)
        index = root / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else ["model.safetensors"]
        names = {"linear_1.": "net.0.", "linear_2.": "net.3."}
        out = {}
        for name in files:
            with safe_open(str(root / name), framework="pt") as f:
                for key in f.keys():
                    rest = key[len(PROJECTOR_PREFIX):] if key.startswith(PROJECTOR_PREFIX) else ""
                    for theirs, ours in names.items():
                        if rest.startswith(theirs):
                            out[ours + rest[len(theirs):]] = f.get_tensor(key)
        if set(out) != {"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"}:
            raise ValueError(f"model.path {self.path!r}: no multi_modal_projector.linear_1 / linear_2 weights found")
        return out

    # ------------------------------------------------------------------ forward
    def encode(self, feats: torch.Tensor, lens: list[int], packed: bool) -> tuple[torch.Tensor, FrameLayout]:
        """Checked feats (FlatEncoder.forward_flat) -> flat rows ``(ΣT', D)`` and their packed layout."""
        if feats.shape[-1] != self.num_mel_bins:
            raise ValueError(f"Qwen3-ASR expects {self.num_mel_bins} mel bins (its config), feats have {feats.shape[-1]}")
        if any(n < 1 for n in lens):
            raise ValueError(f"every utterance needs >= 1 mel frame, got lengths {lens}")
        too_long = [i for i, n in enumerate(lens) if n > MAX_FRAMES]
        if too_long:
            raise ValueError(f"utterances {too_long} have {[lens[i] for i in too_long]} mel frames, more than "
                             f"Qwen3-ASR's {MAX_FRAMES}; the data pipeline must skip them (counted), never truncate")
        if not packed:   # the real frames of every row, in order (indices built on the host)
            rows = torch.cat([i * feats.shape[1] + torch.arange(n) for i, n in enumerate(lens)])
            feats = feats.reshape(-1, feats.shape[-1]).index_select(0, to_device(rows, feats.device))
        x, out_lens = self._forward_packed(feats, lens)
        return x, FrameLayout(out_lens, x.device)

    def _forward_packed(self, mel: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, list[int]]:
        hf, dev, c = self.hf, mel.device, self.chunk
        # every utterance's chunks, zero-padded to whole chunks: frame j of utterance i -> row (first chunk
        # of i) * c + j of a (Σ chunks * c, n_mels) buffer
        n_chunks = [-(-n // c) for n in lens]
        first = torch.tensor([0] + n_chunks[:-1]).cumsum(0) * c
        starts = torch.tensor([0] + lens[:-1]).cumsum(0)
        seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        dst = first[seg] + torch.arange(sum(lens)) - starts[seg]
        buf = mel.new_zeros(sum(n_chunks) * c, mel.shape[1]).index_copy(0, to_device(dst, dev), mel)
        h = buf.view(-1, c, mel.shape[1]).transpose(1, 2).unsqueeze(1)          # (chunks, 1, n_mels, c)
        h = F.gelu(hf.conv2d3(F.gelu(hf.conv2d2(F.gelu(hf.conv2d1(h))))))       # (chunks, ch, f, t)
        n, ch, f, t = h.shape
        h = hf.conv_out(h.permute(0, 3, 1, 2).reshape(n, t, ch * f))
        h = h + hf.positional_embedding.positional_embedding[:t].to(h.dtype)
        # the frames each chunk's real mel frames give, chunk by chunk
        kept = torch.tensor([chunked_frames(CONV_STAGES, c, min(c, m - k * c)) for m, nc in zip(lens, n_chunks)
                             for k in range(nc)])
        keep = torch.repeat_interleave(torch.arange(n) * t - (kept.cumsum(0) - kept), kept) + torch.arange(int(kept.sum()))
        h = h.reshape(n * t, -1).index_select(0, to_device(keep, dev))
        out_lens = [chunked_frames(CONV_STAGES, c, m) for m in lens]
        # attention windows: each utterance's frames in windows of self.window, the last the remainder
        windows = [w for m in out_lens for w in attention_windows(m, self.window)]
        cu = torch.zeros(len(windows) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(windows).cumsum(0)
        kw = packed_kwargs(to_device(cu, dev), max(windows), backend=self.backend, host_cu_seqlens=cu)
        # the layers' own cu_seqlens argument is one span: their non-flash path would split it on the host
        # and attend per span; west's attention attends per window from cu_seq_lens_q in one call
        whole = torch.tensor([0, h.shape[0]], dtype=torch.int32)
        for layer in hf.layers:
            h = layer(h, whole, **kw)[0]
        return hf.ln_post(h), out_lens


def attention_windows(n_frames: int, window: int) -> list[int]:
    """One utterance's encoder frames in attention windows: whole windows, then the rest (if any)."""
    return [window] * (n_frames // window) + ([n_frames % window] if n_frames % window else [])


def encoder_frames(n_frames: int, chunk: int = 100) -> int:
    """Qwen3-ASR encoder frames for ``n_frames`` log-mel frames (its processor's audio token count)."""
    return chunked_frames(CONV_STAGES, chunk, n_frames)
