"""The loader end to end: coverage, batch contract, budgets, shares, determinism, resume."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from west.batch import COUNTER_NAMES, IGNORE_INDEX
from west.data.config import DataConfig
from west.data.dataset import build_dataloader
from west.shapes import PackExtent, SpeechShape, num_speech_tokens

SIZES = dict(batch_size=5, max_tokens_in_batch=300, pack_tokens=400, sort_buffer=10, plan_window=10)
SHAPE = SpeechShape()
KINDS = ["raw", "shard", "kaldi"]


def run(data_list, tok, rank=0, world_size=1, seed=0, epoch=0, training=True, **kw):
    conf = DataConfig(**{**SIZES, **kw})
    loader, ds = build_dataloader(str(data_list), tok, conf, SHAPE, rank, world_size, seed, epoch, training)
    return list(loader), ds


def keys(batches) -> list[str]:
    return [k for b in batches for k in b.keys]


def segments(batch):
    """(row, start, end) of every cu_seqlens segment."""
    cu = batch.cu_seqlens.tolist()
    width = batch.input_ids.shape[1]
    return [(a // width, a % width, a % width + (b - a)) for a, b in zip(cu[:-1], cu[1:])]


def check_speech(batch, tok):
    ph = tok.convert_tokens_to_ids("<|speech|>")
    for (row, start, length), t in zip(batch.speech_spans.tolist(), batch.feat_lens.tolist()):
        assert length == num_speech_tokens(t)
        assert (batch.input_ids[row, start:start + length] == ph).all()
        assert (batch.labels[row, start:start + length] == IGNORE_INDEX).all()
    assert int((batch.input_ids == ph).sum()) == int(batch.speech_spans[:, 2].sum())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_type", ["static", "dynamic", "pack"])
def test_every_mode_yields_every_utterance_once(corpus, list_kinds, tokenizer, batch_type, kind):
    batches, ds = run(list_kinds[kind], tokenizer, batch_type=batch_type)
    assert len(batches) == len(ds)
    assert Counter(keys(batches)) == Counter(list(corpus["texts"]))
    assert ds.stats.skipped == 0
    for b in batches:
        assert set(b.counters) == set(COUNTER_NAMES)
        assert b.counters["utterances"] == len(b.keys)
        assert b.counters["label_tokens"] == int((b.labels != IGNORE_INDEX).sum())


@pytest.mark.parametrize("kind", KINDS)
def test_the_plan_knows_each_packs_encoder_frames(list_kinds, tokenizer, kind):
    """pack_extent (what train.encoder_graphs sizes its replay by) is what the fullest packs hold in
    the encoder as the batches then hold it (frames, segments, the longest segment), known from the
    list before any audio is read."""
    batches, ds = run(list_kinds[kind], tokenizer, batch_type="pack")
    per_segment = [[SHAPE.encoder_frames(int(t)) for t in b.feat_lens] for b in batches]
    held = [sum(f) for f in per_segment]
    planned = [int(ds.encoder_frames[ids].sum()) for ids in ds.rank_batches()]
    assert len(held) > 2 and len(set(held)) > 1
    if kind == "raw":   # lengths from durations: an upper bound, within a frame or two per utterance
        assert all(0 <= p - h <= 2 * len(b.keys) for p, h, b in zip(planned, held, batches)), (planned, held)
        assert 0 <= ds.pack_extent().longest - max(map(max, per_segment)) <= 2
    else:               # frame counts in the shard index and in utt2num_frames: exact
        assert planned == held
        assert ds.pack_extent().longest == max(map(max, per_segment))
    segments = [len(f) for f in per_segment]
    assert len(set(segments)) > 1
    extent = PackExtent(max(planned), max(segments), ds.pack_extent().longest)
    assert ds.pack_extent() == extent
    loader, _ = build_dataloader(str(list_kinds[kind]), tokenizer, DataConfig(**{**SIZES, "batch_type": "pack"}), SHAPE)
    assert loader.pack_extent() == extent   # the loader's TrainData method


def test_the_plan_counts_every_audio_part_as_a_segment(corpus, tokenizer, tmp_path):
    """A conversation's audio parts are segments of their own in the encoder: pack_extent counts
    them, and takes the longest part, not the conversation's frames."""
    from helpers.corpus import write_jsonl

    rows = corpus["rows"]
    chats = [{"key": f"chat{i}", "messages": [
        {"role": "user", "content": [{"type": "audio", "audio": a["wav"], "duration": a["duration"]},
                                     {"type": "audio", "audio": b["wav"], "duration": b["duration"]}]},
        {"role": "assistant", "content": a["txt"]}]} for i, (a, b) in enumerate(zip(rows[:12:2], rows[1:12:2]))]
    lst = write_jsonl(tmp_path / "chats.list", chats + rows[12:])
    batches, ds = run(lst, tokenizer, batch_type="pack")
    per_segment = [[SHAPE.encoder_frames(int(t)) for t in b.feat_lens] for b in batches]
    assert max(len(f) for f in per_segment) > max(len(b.keys) for b in batches)   # parts, not records
    extent = ds.pack_extent()
    assert extent.segments == max(len(f) for f in per_segment)
    assert 0 <= extent.longest - max(map(max, per_segment)) <= 2   # from durations: a frame or two over
    assert extent.encoder_frames >= max(map(sum, per_segment))


@pytest.mark.parametrize("layout,multiple", [("packed", 64), ("padded", 64), ("packed", 0)])
@pytest.mark.parametrize("kind", ["raw", "shard"])
def test_pack_batches_follow_the_contract(list_kinds, tokenizer, layout, multiple, kind):
    batches, _ = run(list_kinds[kind], tokenizer, batch_type="pack", encoder_layout=layout,
                     pack_pad_multiple=multiple, plan_window=100)
    widths = set()
    for b in batches:
        real_tokens = b.counters["real_llm_tokens"]
        width = 400 if multiple == 0 else min(400, -(-real_tokens // multiple) * multiple)
        widths.add(width)
        assert b.input_ids.shape == (1, width) and b.attention_mask is None
        assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == width
        segs = segments(b)
        real = segs[:len(b.keys)]
        tail = segs[len(b.keys):]
        assert len(tail) <= 1 and b.max_seqlen == max(e - s for _, s, e in segs)
        for row, s, e in segs:   # positions restart at 0 and count up inside every segment, tail included
            assert b.position_ids[row, s:e].tolist() == list(range(e - s))
        for row, s, e in tail:
            assert (b.labels[row, s:e] == IGNORE_INDEX).all()
            assert (b.input_ids[row, s:e] == tokenizer.pad_token_id).all()
        assert b.counters["real_llm_tokens"] == sum(e - s for _, s, e in real)
        assert b.counters["computed_llm_tokens"] == width
        for row, s, e in real:   # no label crosses a sample boundary: last position predicts nothing
            assert b.labels[row, e - 1] == IGNORE_INDEX
        check_speech(b, tokenizer)
        for (row, start, length), seg in zip(b.speech_spans.tolist(), real):
            assert seg[1] <= start and start + length <= seg[2]
        assert b.counters["real_enc_frames"] == int(b.feat_lens.sum())
        if layout == "packed":
            assert b.feats.shape == (int(b.feat_lens.sum()), 80)
            assert b.feat_cu_seqlens.tolist() == [0] + torch.cumsum(b.feat_lens, 0).tolist()
            assert b.feat_max_len == int(b.feat_lens.max())
            assert b.counters["computed_enc_frames"] == b.counters["real_enc_frames"]
        else:
            assert b.feat_cu_seqlens is None and b.feats.shape == (len(b.feat_lens), int(b.feat_lens.max()), 80)
            assert b.counters["computed_enc_frames"] == b.feats.shape[0] * b.feats.shape[1]
    assert (min(widths) < 400) == (multiple > 0)   # the last, partial pack is trimmed


@pytest.mark.parametrize("kind", ["raw", "shard"])
@pytest.mark.parametrize("batch_type", ["static", "dynamic"])
def test_padded_batches_follow_the_contract(list_kinds, tokenizer, batch_type, kind):
    batches, _ = run(list_kinds[kind], tokenizer, batch_type=batch_type)
    for b in batches:
        n, width = b.input_ids.shape
        lens = b.attention_mask.sum(1)
        assert b.cu_seqlens is None and int(lens.max()) == width
        assert (b.position_ids == torch.arange(width)).all()
        assert (b.labels[b.attention_mask == 0] == IGNORE_INDEX).all()
        assert (b.input_ids[b.attention_mask == 0] == tokenizer.pad_token_id).all()
        if batch_type == "dynamic":
            assert n * width <= SIZES["max_tokens_in_batch"]     # padded budget, not the sum of lengths
        else:
            assert n <= SIZES["batch_size"]
        assert b.counters["computed_llm_tokens"] == n * width
        assert b.counters["real_llm_tokens"] == int(lens.sum())
        assert b.feats.shape == (n, int(b.feat_lens.max()), 80)
        assert b.counters["computed_enc_frames"] == n * int(b.feat_lens.max())
        check_speech(b, tokenizer)


@pytest.mark.parametrize("batch_type", ["static", "pack"])
def test_labels_are_transcript_and_end_token(corpus, tokenizer, batch_type):
    batches, _ = run(corpus["list"], tokenizer, batch_type=batch_type)
    seen = 0
    for b in batches:
        if batch_type == "pack":
            spans = segments(b)[:len(b.keys)]
        else:
            spans = [(r, 0, int(b.attention_mask[r].sum())) for r in range(len(b.keys))]
        for key, (row, s, e) in zip(b.keys, spans):
            lab = b.labels[row, s:e]
            assert tokenizer.decode(lab[lab != IGNORE_INDEX]) == corpus["texts"][key] + "<|im_end|>"
            seen += 1
    assert seen == len(corpus["texts"])


def test_dynamic_budget_is_respected_with_a_sort_buffer(corpus, tokenizer):
    for budget in (120, 200, 700):
        batches, _ = run(corpus["list"], tokenizer, batch_type="dynamic", max_tokens_in_batch=budget)
        assert all(b.input_ids.numel() <= budget for b in batches)
        assert Counter(keys(batches)) == Counter(list(corpus["texts"]))


@pytest.mark.parametrize("kind", ["raw", "shard"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_rank_and_worker_shares_are_disjoint_and_cover(corpus, list_kinds, tokenizer, kind, num_workers):
    per_rank = [run(list_kinds[kind], tokenizer, rank=r, world_size=2, batch_type="pack",
                    num_workers=num_workers) for r in range(2)]
    k0, k1 = (keys(b) for b, _ in per_rank)
    assert not set(k0) & set(k1)
    assert Counter(k0 + k1) == Counter(list(corpus["texts"]))
    # every rank gets exactly the same number of steps
    assert len(per_rank[0][0]) == len(per_rank[1][0]) == len(per_rank[0][1])


@pytest.mark.parametrize("kind", ["raw", "shard"])
def test_a_rank_decodes_only_its_own_audio(list_kinds, tokenizer, kind, monkeypatch):
    import west.data.processors as P

    decoded = []
    real = P._load_audio
    monkeypatch.setattr(P, "_load_audio", lambda spec, sr: decoded.append(spec) or real(spec, sr))
    for rank in range(3):
        decoded.clear()
        batches, ds = run(list_kinds[kind], tokenizer, rank=rank, world_size=3, batch_type="dynamic")
        if kind == "raw":
            got = [spec.path.split("/")[-1][:-4] for spec in decoded]
        else:   # shards: the members read, by offset, are exactly this rank's utterances
            member = {(a.tar, a.offset): ds.record(i).key for i in range(len(ds.lengths))
                      for a in ds.record(i).audio}
            got = [member[(spec.tar, spec.offset)] for spec in decoded]
        assert sorted(got) == sorted(keys(batches))


@pytest.mark.parametrize("kind", KINDS)
def test_num_workers_do_not_change_an_epoch(list_kinds, tokenizer, kind):
    ref, _ = run(list_kinds[kind], tokenizer, batch_type="pack", num_workers=0, spec_aug=True)
    for workers in (1, 2):
        other, _ = run(list_kinds[kind], tokenizer, batch_type="pack", num_workers=workers, spec_aug=True)
        assert [b.keys for b in ref] == [b.keys for b in other]
        assert all(torch.equal(a.feats, b.feats) for a, b in zip(ref, other))


def test_order_depends_only_on_seed_and_epoch(corpus, tokenizer):
    a, _ = run(corpus["list"], tokenizer, batch_type="static", seed=3, epoch=1)
    b, _ = run(corpus["list"], tokenizer, batch_type="static", seed=3, epoch=1)
    c, _ = run(corpus["list"], tokenizer, batch_type="static", seed=3, epoch=2)
    assert keys(a) == keys(b) and keys(a) != keys(c)
    assert all(torch.equal(x.feats, y.feats) for x, y in zip(a, b))   # dither is seeded per sample too
    ev, _ = run(corpus["list"], tokenizer, batch_type="static", training=False)
    assert keys(ev) == list(corpus["texts"])                            # eval: list order, no dither
    ev2, _ = run(corpus["list"], tokenizer, batch_type="static", training=False, seed=9, spec_aug=True)
    assert all(torch.equal(x.feats, y.feats) for x, y in zip(ev, ev2))


def _resume_case(corpus, tokenizer, k, workers_before, workers_after, **kw):
    data = str(kw.pop("data", corpus["list"]))
    conf = DataConfig(**{**SIZES, **kw, "num_workers": workers_before})
    loader, ds = build_dataloader(data, tokenizer, conf, SHAPE, seed=5, epoch=2)
    full = list(loader)
    loader, ds = build_dataloader(data, tokenizer, conf, SHAPE, seed=5, epoch=2)
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = ds.state_dict()
    del it
    conf2 = dataclasses.replace(conf, num_workers=workers_after)
    loader2, ds2 = build_dataloader(data, tokenizer, conf2, SHAPE, seed=5, epoch=0)
    ds2.load_state_dict(state)
    rest = list(loader2)
    assert [b.keys for b in rest] == [b.keys for b in full[k:]]
    for a, b in zip(rest, full[k:]):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.feats, b.feats)
    return full


@pytest.mark.parametrize("batch_type,kind,workers,k", [
    ("pack", "raw", 0, 1), ("dynamic", "raw", 2, 1), ("static", "raw", 2, 2),
    ("static", "shard", 0, 2), ("pack", "shard", 2, 1), ("dynamic", "kaldi", 2, 3),
])
def test_resume_reproduces_the_rest_of_the_epoch(corpus, list_kinds, tokenizer, batch_type, kind, workers, k):
    full = _resume_case(corpus, tokenizer, k, workers, workers, batch_type=batch_type, data=list_kinds[kind],
                        spec_aug=True, batch_size=3, max_tokens_in_batch=200, pack_tokens=250)
    assert len(full) > k


@pytest.mark.parametrize("kind", ["raw", "shard"])
def test_resume_may_change_num_workers(corpus, list_kinds, tokenizer, kind):
    _resume_case(corpus, tokenizer, 3, 2, 0, batch_type="static", batch_size=3, data=list_kinds[kind])
    _resume_case(corpus, tokenizer, 2, 0, 2, batch_type="pack", pack_tokens=250, data=list_kinds[kind])


def test_state_at_an_epoch_boundary(corpus, tokenizer):
    conf = DataConfig(**{**SIZES, "batch_type": "static"})
    loader, ds = build_dataloader(str(corpus["list"]), tokenizer, conf, SHAPE, seed=1)
    n = len(list(loader))
    end = ds.state_dict()
    assert end["epoch"] == 0 and end["consumed"] == n
    loader2, ds2 = build_dataloader(str(corpus["list"]), tokenizer, conf, SHAPE, seed=1)
    ds2.load_state_dict(end)
    assert list(loader2) == []                       # epoch 0 was finished
    ds2.set_epoch(1)
    assert ds2.state_dict()["consumed"] == 0 and ds2.state_dict()["epoch"] == 1
    ds.set_epoch(1)
    assert [b.keys for b in loader2] == [b.keys for b in loader]


def test_resume_checks_the_config(corpus, tokenizer):
    _, ds = run(corpus["list"], tokenizer, batch_type="pack")
    state = ds.state_dict()
    _, other = run(corpus["list"], tokenizer, batch_type="pack", pack_tokens=500)
    with pytest.raises(ValueError, match="batching options"):
        other.load_state_dict(state)
    _, other = run(corpus["list"], tokenizer, batch_type="pack", plan_window=7)
    with pytest.raises(ValueError, match="batching options"):
        other.load_state_dict(state)
    _, other = run(corpus["list"], tokenizer, batch_type="pack", shared_prefix=True)   # other rows planned
    with pytest.raises(ValueError, match="batching options"):
        other.load_state_dict(state)
    _, same = run(corpus["list"], tokenizer, batch_type="pack", shared_prefix=False)
    same.load_state_dict(state)
    _, other = run(corpus["list"], tokenizer, batch_type="pack", seed=1)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
