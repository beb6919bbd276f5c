"""Forward FLOPs of a Whisper-style audio tower (Whisper's encoder, Qwen2-Audio's audio tower)
on one utterance, by arithmetic: what running it per utterance instead of padded to 30 s saves.

Counted as torch's flop counter counts them (2 per multiply-add, matrix products and
convolutions only; norms, GELU, softmax and pooling are left out): conv1 (k3, stride 1) over the
log-mel frames, conv2 (k3, stride 2), then per layer the q/k/v/out projections, QKᵀ and PV over
the utterance's own frames, and the two FFN products. tests/test_bench_tower_flops.py checks
the formula against the counter on a tiny tower, packed and padded to 30 s."""
from __future__ import annotations

from dataclasses import dataclass

from west.models.whisper_encoder import whisper_encoder_frames

WINDOW_FRAMES = 3000   # 30 s of 10 ms log-mel frames: what the released models are fed


@dataclass(frozen=True)
class TowerShape:
    d_model: int
    layers: int
    ffn: int
    n_mels: int

    @classmethod
    def of(cls, audio_config) -> "TowerShape":
        """From a transformers Whisper / Qwen2-Audio encoder config."""
        return cls(int(audio_config.d_model), int(audio_config.encoder_layers), int(audio_config.encoder_ffn_dim),
                   int(audio_config.num_mel_bins))


# Qwen2-Audio-7B's audio_config (published config.json; the same encoder shape as Whisper-large-v3)
QWEN2_AUDIO_7B = TowerShape(d_model=1280, layers=32, ffn=5120, n_mels=128)


def tower_flops(mel_frames: int, shape: TowerShape) -> int:
    """Forward FLOPs of the tower on one utterance of ``mel_frames`` log-mel frames, attention
    over its own frames only (packed, or a 3000-frame window for the 30 s padding)."""
    t, d = int(mel_frames), shape.d_model
    c = whisper_encoder_frames(t)
    conv = 2 * t * shape.n_mels * 3 * d + 2 * c * d * 3 * d
    layer = 2 * c * 4 * d * d + 2 * 2 * c * c * d + 2 * 2 * c * d * shape.ffn
    return conv + shape.layers * layer


def padding_saving(mel_frames: int, shape: TowerShape) -> float:
    """Share of the 30 s padded forward's FLOPs that running the utterance alone removes."""
    return 1.0 - tower_flops(mel_frames, shape) / tower_flops(WINDOW_FRAMES, shape)
