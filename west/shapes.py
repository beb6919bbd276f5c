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
# Qwen2-Audio's audio tokens: <|AUDIO|> stands for one audio-tower frame (its processor repeats it
# per frame, west's data side too), between the two delimiters; the model's config names its id.
AUDIO_BOS, AUDIO_PLACEHOLDER, AUDIO_EOS = AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")

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


# One stage of an encoder's front end as the frame count sees it: (kernel, stride, padding).
ConvStage = tuple[int, int, int]


def conv_stages(rate: int) -> tuple[ConvStage, ...]:
    """The Conv2d subsampling of ``rate`` (no time padding) as frame stages."""
    if rate not in SUBSAMPLING_LAYERS:
        raise ValueError(f"subsampling rate must be one of {sorted(SUBSAMPLING_LAYERS)}, got {rate}")
    return tuple((kernel, stride, 0) for kernel, stride in SUBSAMPLING_LAYERS[rate])


def frames_after(stages: tuple[ConvStage, ...], n_frames: int) -> int:
    """Frames left after ``stages`` (convolutions or poolings, each (kernel, stride, padding) with
    padding on both sides) of ``n_frames`` input frames; 0 once a stage has too few to read."""
    t = int(n_frames)
    for kernel, stride, pad in stages:
        if t + 2 * pad < kernel:
            return 0
        t = (t + 2 * pad - kernel) // stride + 1
    return t


def chunked_frames(stages: tuple[ConvStage, ...], chunk: int, n_frames: int) -> int:
    """Frames left after ``stages`` run on each chunk of ``chunk`` input frames on its own (the last
    chunk partial, its stages reading zeros past its end): full chunks times a chunk's frames, plus
    the frames of the rest."""
    n = int(n_frames)
    return (n // chunk) * frames_after(stages, chunk) + frames_after(stages, n % chunk)


@dataclass(frozen=True)
class SpeechShape:
    """The model geometry the data side needs, derived once from the model config
    (``SpeechLLMConfig.speech_shape()``, from the encoder's entry in ``west.models.encoders``) and
    handed to the loader; never copied into the data config.

    ``frame_stages`` is the encoder's frame formula ((kernel, stride, padding) per stage; None: the
    Conformer's Conv2d subsampling of ``subsampling_rate``); ``max_frames`` the longest input the
    encoder takes (a 30 s window: longer utterances are a counted ``too_long`` skip when the epoch
    is planned); ``num_mel_bins`` the feature width the encoder reads when the model fixes it;
    ``features`` the data side's feature kind (``data.features``) it reads; ``speech_token`` the
    text the chat template stands a speech segment with (replaced by ``slots(T)`` of its id), and
    ``audio_parts`` whether the template takes audio as a typed part of a message's content (a
    released speech LLM's own template) rather than as that text inside a string.
    ``encoder_type`` names the encoder, for messages and the data state's fingerprint.
    ``chunk_frames``: an encoder whose front end runs on chunks of that many feature frames, each on
    its own (None: on the whole utterance); ``audio_tokens`` the (start, placeholder, end) tokens of
    a released speech LLM's tokenizer that frame a speech part (default: Qwen2-Audio's)."""

    subsampling_rate: int = 4
    projector_stride: int = 2
    encoder_type: str = "conformer"
    max_frames: Optional[int] = None
    num_mel_bins: Optional[int] = None
    frame_stages: Optional[tuple[ConvStage, ...]] = None
    features: str = "fbank"
    speech_token: str = SPEECH_MARKER
    audio_parts: bool = False
    chunk_frames: Optional[int] = None
    audio_tokens: tuple[str, str, str] = AUDIO_TOKENS

    def stages(self) -> tuple[ConvStage, ...]:
        """The frame formula: ``frame_stages``, else the Conv2d subsampling of ``subsampling_rate``."""
        return self.frame_stages if self.frame_stages is not None else conv_stages(self.subsampling_rate)

    def encoder_frames(self, n_frames: int) -> int:
        """Encoder output frames for ``n_frames`` feature frames."""
        if self.chunk_frames:
            return chunked_frames(self.stages(), self.chunk_frames, n_frames)
        return frames_after(self.stages(), n_frames)

    def slots(self, n_frames: int) -> int:
        """LLM placeholder slots for ``n_frames`` feature frames."""
        return projected_frames(self.encoder_frames(n_frames), self.projector_stride)

    def min_frames(self) -> int:
        """Fewest feature frames that still give one slot."""
        t = 1
        while self.encoder_frames(t) < 1:
            t += 1
        return t


@dataclass(frozen=True)
class PackExtent:
    """What the fullest batches of an epoch's plan hold in the speech encoder, known from the lists'
    lengths before any audio is read: a replay captured at one shape (``train.encoder_graphs``) is
    sized from it, so that it pads no more than the data needs. 0: unknown."""

    encoder_frames: int = 0   # the most encoder frames (after subsampling) in one batch
    segments: int = 0         # the most speech segments (utterances) in one batch
    longest: int = 0          # the longest speech segment, in encoder frames
