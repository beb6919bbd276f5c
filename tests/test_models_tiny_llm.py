"""The tiny stand-in LLM: character tokenizer for Chinese, and its text-only pretraining."""
import pytest
import torch

from west.models.tiny_llm import PAD_ID, build_tiny_llm, pretrain_transcriber

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["保护经过单位", "表示特别一点", "经济社会长江", "组织人口关系", "建筑革命计划", "主任进行领导"] * 5


def test_han_characters_are_single_tokens_and_round_trip(tmp_path):
    from transformers import AutoTokenizer

    build_tiny_llm(TEXTS + ["Transcribe the speech."], tmp_path / "llm", vocab_size=800,
                   hidden_size=32, intermediate_size=64)
    tok = AutoTokenizer.from_pretrained(tmp_path / "llm")
    text = "保护经过 Transcribe the speech."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids[:4]] == list("保护经过")   # no merge across characters
    assert tok.decode(ids) == text
    assert tok.pad_token_id == PAD_ID and tok.eos_token == "<|im_end|>"


def test_pretraining_teaches_the_copy_task_and_saves(tmp_path):
    from transformers import AutoModelForCausalLM

    d = build_tiny_llm(TEXTS + ["Transcribe the speech."], tmp_path / "llm", vocab_size=300,
                       hidden_size=32, intermediate_size=64)
    before = AutoModelForCausalLM.from_pretrained(d).model.embed_tokens.weight.clone()
    res = pretrain_transcriber(d, TEXTS, steps=120, lr=5e-3, batch_size=8, progress=False)
    assert res["loss"] < 0.7 * res["first_loss"] and res["acc"] > res["first_acc"]
    after = AutoModelForCausalLM.from_pretrained(d).model.embed_tokens.weight
    assert not torch.equal(before, after)          # the pretrained weights were written back
    with pytest.raises(ValueError, match="speech"):
        pretrain_transcriber(d, TEXTS, steps=1, prompt="no marker", progress=False)


def test_speech_streams_match_the_projectors_layouts():
    import random

    from west.models.tiny_llm import speech_stream

    ids = [5, 6, 5, 7]
    ctc = speech_stream(ids, 0, random.Random(1), max_blanks=3)
    collapsed = [t for i, t in enumerate(ctc) if t != 0 and (i == 0 or ctc[i - 1] != t)]
    assert collapsed == ids and ctc[-1] == 0 and 2 * len(ids) <= len(ctc) <= 5 * len(ids)
    compact = speech_stream(ids, 0, random.Random(1), max_blanks=3, compact=True)
    assert compact == ids + [0] * (len(ctc) - len(ids))    # same length, tokens first
