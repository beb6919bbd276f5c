"""Render a record through the tokenizer's chat template into ids and labels.

Audio parts become the speech marker, rendered by the template like any text,
then replaced by ``SpeechShape.slots(T)`` placeholder ids (the exact number of
embeddings encoder + projector produce, from ``west.shapes``). Assistant
contents are rendered as sentinels and tokenized on their own, so the label
region is exact whatever the template looks like: the content tokens plus the
end token (``tokenizer.eos_token``) that the template puts after them. Text the
template emits after the last end token (Qwen: a newline) is dropped; it would
be an unlabelled token every sample pays for.

Labels are returned SHIFTED (see west/batch.py): ``labels[t]`` is the token to
predict at position t, IGNORE_INDEX at the last position.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from west.batch import IGNORE_INDEX
from west.data.records import Record
from west.data.stats import SkipSample
from west.shapes import AUDIO_PLACEHOLDER, SPEECH_MARKER, SpeechShape

if TYPE_CHECKING:   # the config module checks its keys against the policies, which import this one
    from west.data.config import DataConfig

_SENTINEL = "\x00L{}\x00"
_CACHE_MAX = 4096
# a speech part as a chat template that renders audio content items takes it (Qwen2-Audio's)
AUDIO_ITEM = {"type": "audio", "audio_url": "speech"}


def _splitter(marker: str) -> re.Pattern:
    """Splits a rendered chat into label sentinels, speech markers and text."""
    return re.compile(r"(\x00L\d+\x00|" + re.escape(marker) + ")")


@dataclass
class Encoded:
    ids: list[int]
    labels: list[int]                 # shifted; IGNORE_INDEX where nothing is predicted
    spans: list[tuple[int, int]]      # (start, length) per audio part, in record order
    # transcript token ids per audio part (the CTC target); [] where the record does not say
    # what was spoken (conversations: an assistant turn need not be a transcript)
    transcripts: list[list[int]] = field(default_factory=list)
    # leading ids that are the data's shared prompt prefix (data.shared_prefix): a pack row holds them
    # once for all its samples; 0 where the sample does not start with it
    shared: int = 0


class PromptEncoder:
    """Turns records into token ids with speech placeholder spans and shifted labels."""

    def __init__(self, tokenizer, conf: DataConfig, shape: SpeechShape):
        self.tok = tokenizer
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has no eos_token: it marks the end of an assistant turn")
        self.end_text: str = tokenizer.eos_token
        self.pad_id: int = pad_token_id(tokenizer)
        # the model's audio tokens (shape.audio_tokens: Qwen2-Audio's <|audio_bos|> <|AUDIO|> <|audio_eos|>
        # unless the encoder names its own, e.g. Qwen3-ASR's <|audio_start|> <|audio_pad|> <|audio_end|>)
        bos, placeholder, eos = shape.audio_tokens
        self.placeholder_id: int = speech_placeholder_id(tokenizer, placeholder)
        # How a speech part reaches the chat template. A template that renders audio content items
        # (Qwen2-Audio's: "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\n") gets them, and its one
        # placeholder per part marks the slots; otherwise the text holds the marker, between the
        # model's audio delimiters when its tokenizer has them.
        vocab = tokenizer.get_vocab()
        self.audio_items = _renders_audio_items(tokenizer, placeholder)
        self.marker = placeholder if self.audio_items else SPEECH_MARKER
        self._split = _splitter(self.marker)
        self.speech_text = f"{bos}{SPEECH_MARKER}{eos}" if bos in vocab and eos in vocab else SPEECH_MARKER
        self.prompt, self.system = conf.prompt, conf.system_prompt
        self.shape = shape
        self._text_cache: dict[str, list[int]] = {}
        self._asr_pieces = self._pieces(self._asr_messages(), n_audio=1)   # also checks the template
        # data.shared_prefix: the ASR prompt's ids before its speech (empty: nothing is shared)
        self.prefix: list[int] = self._leading_ids(self._asr_pieces) if conf.shared_prefix else []

    # -- rendering --------------------------------------------------------
    def _text(self, parts: Sequence[tuple[str, object]]) -> str:
        """A turn's (kind, value) parts as one text, each speech part marked."""
        return "".join(self.speech_text if kind == "audio" else str(v) for kind, v in parts)

    def _content(self, parts: Sequence[tuple[str, object]]):
        """A user/system turn as the template takes it: audio items, or the marked text."""
        if self.audio_items and any(kind == "audio" for kind, _ in parts):
            return [AUDIO_ITEM if kind == "audio" else {"type": "text", "text": str(v)} for kind, v in parts
                    if kind == "audio" or str(v)]
        return self._text(parts)

    def _asr_messages(self) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system is not None else []
        before, after = self.prompt.split(SPEECH_MARKER, 1)
        return msgs + [{"role": "user", "content": self._content([("text", before), ("audio", 0), ("text", after)])},
                       {"role": "assistant", "content": _SENTINEL.format(0)}]

    def _chat_messages(self, record: Record) -> tuple[list[dict], list[str]]:
        msgs, labels = [], []
        for m in record.messages or []:
            if m.role == "assistant":
                labels.append(self._text(m.parts))
                msgs.append({"role": m.role, "content": _SENTINEL.format(len(labels) - 1)})
            else:
                msgs.append({"role": m.role, "content": self._content(m.parts)})
        return msgs, labels

    def _pieces(self, msgs: list[dict], n_audio: int, generation: bool = False) -> list[tuple[str, object]]:
        """Template output split into ("text", s) | ("speech", audio_i) | ("label", label_i) | ("end", s)."""
        rendered = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation)
        pieces: list[tuple[str, object]] = []
        n_speech, expect_end = 0, False
        for part in self._split.split(rendered):
            if part == self.marker:
                pieces.append(("speech", n_speech))
                n_speech += 1
                continue
            if part.startswith("\x00L"):
                pieces.append(("label", int(part[2:-1])))
                expect_end = True
                continue
            if expect_end:
                if not part.startswith(self.end_text):
                    raise ValueError(f"chat template does not put {self.end_text!r} right after an "
                                     f"assistant turn (got {part[:30]!r}); cannot place labels")
                pieces.append(("end", self.end_text))
                part, expect_end = part[len(self.end_text):], False
            if part:
                pieces.append(("text", part))
        if expect_end:
            raise ValueError(f"chat template does not end assistant turns with {self.end_text!r}")
        if n_speech != n_audio:
            raise SkipSample("malformed_line", f"{n_audio} audio part(s) but {n_speech} speech markers "
                             f"after rendering (text may contain {self.marker!r})")
        if not generation:
            last_end = max((i for i, (k, _) in enumerate(pieces) if k == "end"), default=-1)
            if last_end >= 0 and all(k == "text" and not str(v).strip() for k, v in pieces[last_end + 1:]):
                pieces = pieces[:last_end + 1]
        return pieces

    def _record_pieces(self, record: Record) -> tuple[list, list[str]]:
        if record.messages is None:
            return self._asr_pieces, [record.txt or ""]
        msgs, labels = self._chat_messages(record)
        return self._pieces(msgs, len(record.audio)), labels

    # -- token ids --------------------------------------------------------
    def _text_ids(self, text: str) -> list[int]:
        ids = self._text_cache.get(text)
        if ids is None:
            if len(self._text_cache) >= _CACHE_MAX:
                self._text_cache.clear()
            ids = self._text_cache[text] = self._ids([text])[0]
        return ids

    def _piece_lengths(self, pieces, label_lens: Sequence[int], frames: Sequence[int]) -> list[int]:
        """Tokens each piece takes: the one length rule of planning (:meth:`lengths`) and of
        assembly (:meth:`_assemble`). A speech part too short for one encoder frame is a skip."""
        out = []
        for kind, v in pieces:
            if kind == "speech":
                n = self.shape.slots(frames[v])
                if n < 1:
                    raise SkipSample("too_short", f"{frames[v]} fbank frames give no encoder frame")
            else:
                n = label_lens[v] if kind == "label" else len(self._text_ids(v))
            out.append(n)
        return out

    def _leading_ids(self, pieces, enough: int = 1 << 30) -> list[int]:
        """Ids of the text pieces before the first speech or label piece (at least ``enough`` of them
        where there are that many)."""
        ids: list[int] = []
        for kind, v in pieces:
            if kind != "text" or len(ids) >= enough:
                break
            ids += self._text_ids(v)
        return ids

    def _shared(self, pieces) -> int:
        """How many leading ids of a record with these pieces are the shared prompt prefix: all of it,
        or 0 where the record starts otherwise, is nothing more, or would predict a label from its last token."""
        n = len(self.prefix)
        if not n:
            return 0
        lead = self._leading_ids(pieces, enough=n + 1)
        if lead[:n] != self.prefix:
            return 0
        after = pieces[next((i for i, (k, _) in enumerate(pieces) if k != "text"), len(pieces)):]
        if len(lead) == n and (not after or after[0][0] in ("label", "end")):
            return 0
        return n

    def _assemble(self, pieces, label_ids: Sequence[list[int]], frames: Sequence[int]) -> Encoded:
        ids: list[int] = []
        target: list[bool] = []
        spans: list[tuple[int, int]] = [(0, 0)] * len(frames)
        for (kind, v), n in zip(pieces, self._piece_lengths(pieces, [len(x) for x in label_ids], frames)):
            if kind == "speech":
                spans[v] = (len(ids), n)
                ids += [self.placeholder_id] * n
            else:
                ids += label_ids[v] if kind == "label" else self._text_ids(v)
            target += [kind in ("label", "end")] * n
        labels = [ids[t + 1] if target[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
        return Encoded(ids, labels, spans)

    def _ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts, without special tokens. Every path (single samples and
        plan-time lengths) goes through here, so they cannot disagree; the Rust backend is
        called directly when there is one (2x faster than the Python wrapper)."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def encode(self, record: Record, frames: Sequence[int]) -> Encoded:
        """Ids, shifted labels and speech spans; ``frames[i]`` = fbank frames of audio i."""
        pieces, label_texts = self._record_pieces(record)
        label_ids = self._ids(label_texts)
        enc = self._assemble(pieces, label_ids, frames)
        plain_asr = record.messages is None
        enc.transcripts = [list(label_ids[0])] if plain_asr else [[] for _ in enc.spans]
        enc.shared = self._shared(pieces)
        return enc

    def lengths(self, records: Sequence[Record], frames: Sequence[Sequence[int]]) -> list[int]:
        """The tokens a sample takes in a batch, ``len(ids) - shared`` of :meth:`encode`, for many
        records at once (transcripts tokenized in a batch); 0 where a record's audio is too short
        to give a speech token."""
        all_pieces, flat, owner = [], [], []
        for r_i, rec in enumerate(records):
            pieces, label_texts = self._record_pieces(rec)
            all_pieces.append(pieces)
            flat += label_texts
            owner += [r_i] * len(label_texts)
        label_len = [len(x) for x in self._ids(flat)] if flat else []
        per_record: list[list[int]] = [[] for _ in records]
        for r_i, n in zip(owner, label_len):
            per_record[r_i].append(n)
        out = []
        for pieces, lab, fr in zip(all_pieces, per_record, frames):
            try:
                out.append(sum(self._piece_lengths(pieces, lab, fr)) - self._shared(pieces))
            except SkipSample:
                out.append(0)
        return out

    def encode_prompt(self, record: Record, frames: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids up to the header of the first assistant turn (for decoding), with speech spans."""
        if record.messages is None:
            msgs = self._asr_messages()[:-1]
        else:
            msgs, _ = self._chat_messages(record)
            first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            msgs = msgs[:first]
        n_audio = sum(_count_audio(m["content"]) for m in msgs)
        enc = self._assemble(self._pieces(msgs, n_audio, generation=True), [], list(frames)[:n_audio])
        return enc.ids, enc.spans


def _count_audio(content) -> int:
    """Speech parts in a turn's content: markers in a text, audio items in a list."""
    if isinstance(content, str):
        return content.count(SPEECH_MARKER)
    return sum(item.get("type") == "audio" for item in content)


def _renders_audio_items(tokenizer, placeholder: str = AUDIO_PLACEHOLDER) -> bool:
    """Does the tokenizer's chat template render an audio content item as one ``placeholder`` token?"""
    if placeholder not in tokenizer.get_vocab() or not getattr(tokenizer, "chat_template", None):
        return False
    probe = [{"role": "user", "content": [AUDIO_ITEM, {"type": "text", "text": "x"}]}]
    try:
        rendered = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:   # a template that takes only string contents (jinja raises its own errors)
        return False
    return rendered.count(placeholder) == 1


def pad_token_id(tokenizer) -> int:
    """Padding id: the tokenizer's pad token, else its eos token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def speech_placeholder_id(tokenizer, placeholder: str = AUDIO_PLACEHOLDER) -> int:
    """The id the data pipeline writes into speech slots (the model's audio ``placeholder``,
    ``<|speech|>`` or pad)."""
    vocab = tokenizer.get_vocab()
    return vocab.get(placeholder, vocab.get(SPEECH_MARKER, pad_token_id(tokenizer)))
