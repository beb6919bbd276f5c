"""data.shared_prefix on the data side: which ids are shared, how a pack row holds them once, and
how the plan leaves room for them. (That the model trains the same on such rows:
tests/test_data_model_contract.py and tests/test_models_shared_prefix.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from west.batch import IGNORE_INDEX
from west.data.config import DataConfig
from west.data.policies import PackPolicy, collate_packed
from west.data.records import AudioSpec, Message, Record, Sample
from west.data.tokenize import PromptEncoder
from west.shapes import SpeechShape

SHAPE = SpeechShape()


def asr(key: str, txt: str) -> Record:
    return Record(key, f"x:{key}", [AudioSpec()], txt=txt)


def chat(key: str, system: str) -> Record:
    return Record(key, f"x:{key}", [AudioSpec()], messages=[
        Message("system", [("text", system)]), Message("user", [("audio", 0), ("text", "what was said?")]),
        Message("assistant", [("text", "hello")])])


def encoder(tokenizer, **kw) -> PromptEncoder:
    return PromptEncoder(tokenizer, DataConfig(batch_type="pack", shared_prefix=True, **kw), SHAPE)


def sample(pe: PromptEncoder, rec: Record, frames: int) -> Sample:
    enc = pe.encode(rec, [frames])
    return Sample(rec, feats=[np.full((frames, 80), len(rec.key), np.float32)], enc=enc,
                  length=len(enc.ids) - enc.shared)


def test_the_prefix_is_what_the_prompt_says_before_the_speech(tokenizer):
    pe = encoder(tokenizer, system_prompt="You are an ASR model.")
    text = tokenizer.decode(pe.prefix)
    assert text.startswith("<|im_start|>system\nYou are an ASR model.") and text.endswith("<|im_start|>user\n")
    enc = pe.encode(asr("a", "hello world"), [123])
    assert enc.shared == len(pe.prefix) and enc.ids[:enc.shared] == pe.prefix
    assert all(lab == IGNORE_INDEX for lab in enc.labels[:enc.shared])
    # planning counts what a sample adds to a row: one rule with the sample's own length
    assert pe.lengths([asr("a", "hello world")], [[123]]) == [len(enc.ids) - enc.shared]
    plain = PromptEncoder(tokenizer, DataConfig(batch_type="pack", system_prompt="You are an ASR model."), SHAPE)
    assert plain.prefix == [] and plain.encode(asr("a", "hello world"), [123]).shared == 0
    assert plain.encode(asr("a", "hello world"), [123]).ids == enc.ids   # the ids themselves do not change


def test_a_conversation_shares_the_prefix_only_if_it_starts_with_it(tokenizer):
    pe = encoder(tokenizer, system_prompt="system")
    same, other = chat("c1", "system"), chat("c2", "another system")
    assert pe.encode(same, [60]).shared == len(pe.prefix)
    assert pe.encode(other, [60]).shared == 0
    assert pe.lengths([same, other], [[60], [60]]) == [len(pe.encode(same, [60]).ids) - len(pe.prefix),
                                                       len(pe.encode(other, [60]).ids)]


def test_a_row_holds_the_prefix_once_and_each_sample_keeps_its_positions_labels_and_speech(tokenizer):
    pe = encoder(tokenizer, system_prompt="system")
    p = len(pe.prefix)
    row = [sample(pe, asr("a", "hello"), 40), sample(pe, chat("bb", "another system"), 25),
           sample(pe, asr("ccc", "world today"), 64)]
    width = p + sum(s.length for s in row) + 16   # room for a tail segment
    batch = collate_packed([row], width, pe.pad_id, prefix=pe.prefix, pad_multiple=0)
    ids, labels, pos = (t[0].tolist() for t in (batch.input_ids, batch.labels, batch.position_ids))
    assert ids[:p] == pe.prefix and pos[:p] == list(range(p)) and set(labels[:p]) == {IGNORE_INDEX}
    cu, kcu, kidx = batch.cu_seqlens.tolist(), batch.key_cu_seqlens.tolist(), batch.key_index.tolist()
    assert cu[:2] == [0, p] and len(cu) == len(kcu) == len(row) + 3   # prefix, 3 samples, the tail
    at = p
    for i, s in enumerate(row):
        own = len(s.enc.ids) - s.enc.shared
        assert ids[at:at + own] == s.enc.ids[s.enc.shared:]
        assert labels[at:at + own] == s.enc.labels[s.enc.shared:]
        assert pos[at:at + own] == list(range(s.enc.shared, len(s.enc.ids)))   # as if the prefix came first
        want_keys = list(range(s.enc.shared)) + list(range(at, at + own))       # its keys: prefix, then itself
        assert kidx[kcu[i + 1]:kcu[i + 2]] == want_keys and cu[i + 2] - cu[i + 1] == own
        (r, start, n), = batch.speech_spans[i:i + 1].tolist()
        assert (r, start - at) == (0, s.enc.spans[0][0] - s.enc.shared) and n == s.enc.spans[0][1]
        at += own
    assert row[1].enc.shared == 0                                   # the other system turn is laid out whole
    assert batch.counters["real_llm_tokens"] == at == p + sum(s.length for s in row)
    assert batch.key_max_seqlen == max(b - a for a, b in zip(kcu, kcu[1:]))


def test_key_rows_that_do_not_cover_their_index_are_refused_once_per_batch(tokenizer):
    """The model checks the key layout on the batch's host copy, as it checks cu_seqlens: on a GPU
    the kernels would read past the gathered keys without a word."""
    import dataclasses

    from west.models.speech_llm import SpeechLLM

    pe = encoder(tokenizer, system_prompt="system")
    row = [sample(pe, asr("a", "hello"), 40), sample(pe, asr("b", "world"), 30)]
    batch = collate_packed([row], 512, pe.pad_id, prefix=pe.prefix)
    keys = SpeechLLM._key_rows(batch)
    assert keys.index is batch.key_index and keys.max_seqlen == batch.key_max_seqlen
    broken = dataclasses.replace(batch, key_index=batch.key_index[:-1])
    with pytest.raises(ValueError, match="key_cu_seqlens ends at"):
        SpeechLLM._key_rows(broken)


def test_rows_without_a_sharing_sample_have_no_prefix_and_no_key_rows(tokenizer):
    pe = encoder(tokenizer, system_prompt="system")
    row = [sample(pe, chat("c", "another system"), 30)]
    batch = collate_packed([row], 256, pe.pad_id, prefix=pe.prefix)
    assert batch.key_index is None and batch.input_ids[0, :len(row[0].enc.ids)].tolist() == row[0].enc.ids


def test_the_plan_leaves_each_row_room_for_its_prefix(tokenizer):
    pe = encoder(tokenizer)
    conf = DataConfig(batch_type="pack", pack_tokens=300, shared_prefix=True)
    policy = PackPolicy(conf, pe.pad_id, pe.placeholder_id, SHAPE, pe.prefix)
    lengths = np.random.default_rng(0).integers(20, 140, 200)
    order, sizes = policy.group(lengths, 1, None)
    packs = np.split(lengths[order], np.cumsum(sizes)[:-1])
    assert max(len(pe.prefix) + int(p.sum()) for p in packs) <= 300
    assert policy.sample_budget() == 300 - len(pe.prefix)
    with pytest.raises(ValueError, match="data.pack_tokens"):
        PackPolicy(DataConfig(batch_type="pack", pack_tokens=len(pe.prefix), shared_prefix=True),
                   pe.pad_id, pe.placeholder_id, SHAPE, pe.prefix)
