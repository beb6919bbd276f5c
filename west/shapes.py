"""How many positions a speech segment occupies at each stage of the model.

The data pipeline reserves exactly ``num_speech_tokens(n_frames, ...)`` placeholder
slots in the LLM sequence, and the encoder + projector produce exactly that many
embeddings. Both sides import these functions, so they cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# The text that stands for one speech segment in a prompt; the data pipeline replaces it
# with ``SpeechShape.slots(T)`` placeholder ids, the model splices embeddings there.
SPEECH_MARKER = "<|speech|>"

# Conv2d subsampling stacks as (kernel, stride) per layer, WeNet-style, no padding.
SUBSAMPLING_LAYERS: dict[int, tuple[tuple[int, int], ...]] = {
    4: ((3, 2), (3, 2)),
    6: ((3, 2), (5, 3)),
    8: ((3, 2), (3, 2), (3, 2)),
}


def subsampled_frames(n_frames: int, rate: int = 4) -> int:
    """Encoder frames after Conv2d subsampling of ``n_frames`` fbank frames (0 if too short)."""
    if rate not in SUBSAMPLING_LAYERS:
        raise ValueError(f"subsampling rate must be one of {sorted(SUBSAMPLING_LAYERS)}, got {rate}")
    t = int(n_frames)
    for kernel, stride in SUBSAMPLING_LAYERS[rate]:
        if t < kernel:
            return 0
        t = (t - kernel) // stride + 1
    return t


def min_fbank_frames(rate: int = 4) -> int:
    """Fewest fbank frames that still yield one encoder frame."""
    t = 1
    while subsampled_frames(t, rate) < 1:
        t += 1
    return t


def projected_frames(n_encoder_frames: int, stride: int = 2) -> int:
    """Projector outputs for ``n`` encoder frames: stacking ``stride`` frames, the
    last partial group zero-filled (never dropped), so ceil(n / stride)."""
    if stride < 1:
        raise ValueError(f"projector stride must be >= 1, got {stride}")
    return -(-int(n_encoder_frames) // stride)


def whisper_frames(n_frames: int) -> int:
    """Whisper encoder frames for ``n_frames`` log-mel frames: conv1 (k3, s1, p1) keeps T,
    conv2 (k3, s2, p1) gives (T - 1) // 2 + 1 (0 for T = 0)."""
    return (int(n_frames) - 1) // 2 + 1 if n_frames > 0 else 0


def num_speech_tokens(n_frames: int, subsampling_rate: int = 4, projector_stride: int = 2) -> int:
    """LLM placeholder slots for a speech segment of ``n_frames`` fbank frames."""
    return projected_frames(subsampled_frames(n_frames, subsampling_rate), projector_stride)


ENCODER_TYPES = ("conformer", "whisper")


@dataclass(frozen=True)
class SpeechShape:
    """The model geometry the data side needs, derived once from the model config
    (``SpeechLLMConfig.speech_shape()``) and handed to the loader; never copied into
    the data config.

    ``encoder_type`` picks the frame formula (conformer: Conv2d subsampling; whisper: its
    two convolutions); ``max_frames`` is the longest input the encoder takes (Whisper's
    30 s window: longer utterances are a counted ``too_long`` skip when the epoch is
    planned); ``num_mel_bins`` is the feature width the encoder reads, when the model
    fixes it (Whisper's config: 80 or 128)."""

    subsampling_rate: int = 4
    projector_stride: int = 2
    encoder_type: str = "conformer"
    max_frames: Optional[int] = None
    num_mel_bins: Optional[int] = None

    def __post_init__(self) -> None:
        if self.encoder_type not in ENCODER_TYPES:
            raise ValueError(f"encoder_type must be one of {ENCODER_TYPES}, got {self.encoder_type!r}")

    def encoder_frames(self, n_frames: int) -> int:
        """Encoder output frames for ``n_frames`` feature frames."""
        if self.encoder_type == "whisper":
            return whisper_frames(n_frames)
        return subsampled_frames(n_frames, self.subsampling_rate)

    def slots(self, n_frames: int) -> int:
        """LLM placeholder slots for ``n_frames`` feature frames."""
        return projected_frames(self.encoder_frames(n_frames), self.projector_stride)

    def min_frames(self) -> int:
        """Fewest feature frames that still give one slot."""
        return 1 if self.encoder_type == "whisper" else min_fbank_frames(self.subsampling_rate)
