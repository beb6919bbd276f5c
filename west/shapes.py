"""How many positions a speech segment occupies at each stage of the model.

The data pipeline reserves exactly ``num_speech_tokens(n_frames, ...)`` placeholder
slots in the LLM sequence, and the encoder + projector produce exactly that many
embeddings. Both sides import these functions, so they cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass

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


def num_speech_tokens(n_frames: int, subsampling_rate: int = 4, projector_stride: int = 2) -> int:
    """LLM placeholder slots for a speech segment of ``n_frames`` fbank frames."""
    return projected_frames(subsampled_frames(n_frames, subsampling_rate), projector_stride)


@dataclass(frozen=True)
class SpeechShape:
    """The model geometry the data side needs, derived once from the model config
    (``SpeechLLMConfig.speech_shape()``) and handed to the loader; never copied into
    the data config."""

    subsampling_rate: int = 4
    projector_stride: int = 2

    def slots(self, n_frames: int) -> int:
        """LLM placeholder slots for ``n_frames`` feature frames."""
        return num_speech_tokens(n_frames, self.subsampling_rate, self.projector_stride)

    def min_frames(self) -> int:
        """Fewest feature frames that still give one slot."""
        return min_fbank_frames(self.subsampling_rate)
