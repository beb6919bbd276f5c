"""The two shapes data takes on its way to a batch: a ``Record`` (what one list line says,
validated) and a ``Sample`` (that record after audio, features and tokens).

Every list format (jsonl utterances or conversations, tar shards, Kaldi dirs, Lhotse
manifests and Shar, Hugging Face datasets) becomes a Record in west.data.lists; the stages of west.data.processors turn it into a Sample, which a
batching policy collates. Plain classes rather than dicts: a misspelt field is an error where
it is written, and a reader sees what each stage may rely on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

import numpy as np

if TYPE_CHECKING:
    from west.data.tokenize import Encoded

Part = tuple[str, Union[str, int]]   # ("text", str) | ("audio", index into Record.audio)


@dataclass
class AudioSpec:
    """Where one audio part is, and what the list says about its length (None: not said)."""

    path: Optional[str] = None      # an audio file, relative to ``base`` unless absolute
    base: Optional[str] = None      # the list's directory
    ark: Optional[str] = None       # Kaldi features (feats.scp entry), read with kaldiio
    tar: Optional[str] = None       # a member of a tar shard: its file, byte offset and size
    offset: int = 0
    size: int = 0
    data: Optional[bytes] = None    # encoded audio held in memory
    start: Optional[float] = None   # segment start / end in seconds
    end: Optional[float] = None
    duration: Optional[float] = None
    num_frames: Optional[int] = None  # fbank frames (tools/compute_lengths.py writes them)
    channels: Optional[tuple[int, ...]] = None  # the file's channels to keep (their mean); None: the first
    cut: Optional[dict] = None      # a Lhotse cut that lhotse itself loads (transforms, mixes; west.data.lhotse_audio)
    features: Optional[str] = None  # the cut's precomputed Lhotse features instead of audio: "manifest" (their
    #                                 own storage) or a Shar member's format ("llc", "npy": bytes at tar/offset/size)

    def seconds(self) -> Optional[float]:
        """What the list says the part lasts: its duration, else end - start."""
        if self.duration is not None:
            return float(self.duration)
        if self.start is not None and self.end is not None:
            return float(self.end - self.start)
        return None


@dataclass
class Message:
    """One turn of a conversation: its role and its text / audio parts in order."""

    role: str
    parts: list[Part]

    def text(self) -> str:
        return "".join(str(v) for kind, v in self.parts if kind == "text")


@dataclass
class Record:
    """One utterance or conversation as its list line says it."""

    key: str
    src: str                                   # "list.jsonl:17": where a skip warning points
    audio: list[AudioSpec]
    txt: Optional[str] = None                  # a plain ASR utterance's transcript
    messages: Optional[list[Message]] = None   # a conversation (then ``txt`` is None)

    def reference(self) -> str:
        """What the model should produce: the transcript, or the first assistant turn."""
        if self.messages is None:
            return self.txt or ""
        return next((m.text() for m in self.messages if m.role == "assistant"), "")


@dataclass
class Sample:
    """A record after the pipeline's stages: waveforms, then features, then token ids."""

    record: Record
    waves: list[np.ndarray] = field(default_factory=list)
    feats: list[np.ndarray] = field(default_factory=list)   # (T, mel bins) per audio part
    enc: Optional["Encoded"] = None                          # ids, shifted labels, speech spans
    length: int = 0                                          # LLM tokens (len(enc.ids))
    ref: str = ""                                            # decoding: the reference text

    @property
    def key(self) -> str:
        return self.record.key

    @property
    def src(self) -> str:
        return self.record.src
