"""Prompt rendering: speech slots, shifted labels on transcript + end token only."""
from __future__ import annotations

import pytest

from west.batch import IGNORE_INDEX
from west.data.config import DataConfig
from west.data.records import AudioSpec, Message, Record
from west.data.tokenize import PromptEncoder
from west.shapes import SpeechShape, num_speech_tokens


def asr(txt: str) -> Record:
    return Record("a", "x:1", [AudioSpec()], txt=txt)


def labelled_text(tok, enc) -> str:
    return tok.decode([t for t in enc.labels if t != IGNORE_INDEX])


@pytest.mark.parametrize("rate,stride", [(4, 2), (6, 1), (8, 3)])
def test_asr_sample(tokenizer, rate, stride):
    pe = PromptEncoder(tokenizer, DataConfig(), SpeechShape(rate, stride))
    enc = pe.encode(asr("hello world"), [123])
    (start, n), = enc.spans
    assert n == num_speech_tokens(123, rate, stride)
    assert enc.ids[start:start + n] == [tokenizer.convert_tokens_to_ids("<|speech|>")] * n
    assert tokenizer.convert_tokens_to_ids("<|speech|>") not in enc.ids[:start] + enc.ids[start + n:]
    assert labelled_text(tokenizer, enc) == "hello world<|im_end|>"
    # shifted: labels[t] is ids[t+1] wherever set, the last position predicts nothing
    assert len(enc.labels) == len(enc.ids) and enc.labels[-1] == IGNORE_INDEX
    for t, lab in enumerate(enc.labels):
        if lab != IGNORE_INDEX:
            assert lab == enc.ids[t + 1]
    assert enc.ids[-1] == tokenizer.eos_token_id        # nothing after the end token
    assert pe.lengths([asr("hello world")], [[123]]) == [len(enc.ids)]
    # the CTC target of the one speech part: the transcript's tokens, no end token
    assert enc.transcripts == [tokenizer("hello world", add_special_tokens=False)["input_ids"]]


def test_prompt_and_system_prompt_are_not_labelled(tokenizer):
    conf = DataConfig(prompt="Please <|speech|> transcribe", system_prompt="You are an ASR model.")
    enc = PromptEncoder(tokenizer, conf, SpeechShape()).encode(asr("data pack"), [50])
    text = tokenizer.decode(enc.ids)
    assert "You are an ASR model." in text and "Please " in text and " transcribe" in text
    assert labelled_text(tokenizer, enc) == "data pack<|im_end|>"


def test_multi_turn_only_assistant_turns_are_labelled(tokenizer):
    rec = Record("c", "x:2", [AudioSpec(), AudioSpec()], messages=[
        Message("system", [("text", "system")]),
        Message("user", [("audio", 0), ("text", "what was said?")]),
        Message("assistant", [("text", "hello")]),
        Message("user", [("text", "and now "), ("audio", 1)]),
        Message("assistant", [("text", "world today")]),
    ])
    pe = PromptEncoder(tokenizer, DataConfig(), SpeechShape())
    enc = pe.encode(rec, [60, 200])
    assert [n for _, n in enc.spans] == [num_speech_tokens(60), num_speech_tokens(200)]
    assert enc.spans[0][0] < enc.spans[1][0]
    assert labelled_text(tokenizer, enc) == "hello<|im_end|>world today<|im_end|>"
    assert enc.transcripts == [[], []]     # an assistant turn is not known to be a transcript
    assert pe.lengths([rec, asr("x")], [[60, 200], [80]]) == [len(enc.ids), len(pe.encode(asr("x"), [80]).ids)]
    prompt_ids, spans = pe.encode_prompt(rec, [60, 200])
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n") and len(spans) == 1


def test_text_only_conversation(tokenizer):
    rec = Record("t", "x:3", [], messages=[
        Message("user", [("text", "say hello")]), Message("assistant", [("text", "hello")])])
    enc = PromptEncoder(tokenizer, DataConfig(), SpeechShape()).encode(rec, [])
    assert enc.spans == [] and labelled_text(tokenizer, enc) == "hello<|im_end|>"


def test_too_short_audio_and_stray_marker_are_skips(tokenizer):
    from west.data.stats import SkipSample

    pe = PromptEncoder(tokenizer, DataConfig(), SpeechShape())
    with pytest.raises(SkipSample) as e:
        pe.encode(asr("x"), [3])
    assert e.value.category == "too_short"
    rec = Record("m", "x:4", [], messages=[
        Message("user", [("text", "literal <|speech|> in text")]),
        Message("assistant", [("text", "ok")])])
    with pytest.raises(SkipSample) as e:
        pe.encode(rec, [])
    assert e.value.category == "malformed_line"


def test_placeholder_falls_back_to_pad(tokenizer):
    class NoSpeechToken:
        """The tiny tokenizer without <|speech|> in its vocabulary."""
        def __init__(self, tok):
            self._tok = tok

        def get_vocab(self):
            return {k: v for k, v in self._tok.get_vocab().items() if k != "<|speech|>"}

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def __call__(self, *a, **k):
            return self._tok(*a, **k)

    pe = PromptEncoder(NoSpeechToken(tokenizer), DataConfig(), SpeechShape())
    enc = pe.encode(asr("hello"), [40])
    start, n = enc.spans[0]
    assert pe.placeholder_id == tokenizer.pad_token_id
    assert enc.ids[start:start + n] == [tokenizer.pad_token_id] * n
