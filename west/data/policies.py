"""Batching policies: the one place where static, dynamic and pack differ.

A policy answers four questions for its mode:

* what a sample may cost: ``sample_budget()``, the most LLM tokens one sample
  may have (longer samples are counted as ``too_long`` and skipped, never cut);
* how an ordered window of samples becomes batches: ``group(lengths,
  world_size, rng)`` returns window positions batch after batch plus the batch
  sizes; consecutive ``world_size`` batches form one step (one batch per rank);
* how a batch is collated: ``collate(samples, stats)``;
* what a rank trains on when it has nothing: ``dummy_batch()``.

A new mode is one new class here and one entry in ``POLICIES``.

Collation (the layouts of ``west.batch.Batch``):

* ``collate_padded``: static/dynamic; one sample per row, right padded,
  attention_mask, positions 0..L-1 (pads continue counting), encoder feats
  padded (N, Tmax, F).
* ``collate_packed``: pack; rows as wide as the batch's longest row rounded up
  to ``pad_multiple`` (0 = exactly ``pack_tokens``, for fixed shapes);
  positions restart per sample; a non-full row ends with ONE dummy segment (pad
  ids, positions 0..tail-1, no labels) so flash-attn varlen never sees a run of
  position-0 tokens; explicit ``cu_seqlens``/``max_seqlen``; encoder feats
  concatenated (ΣT, F) with ``feat_cu_seqlens`` or, for the ablation, padded.
* ``dummy_sample``: what a rank trains on when its planned samples were all bad.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Optional, Sequence

import numpy as np
import torch

from west.batch import COUNTER_NAMES, IGNORE_INDEX, Batch
from west.data.batching import dynamic_sizes, equalize_rounds, sort_in_windows, split_rows, static_sizes
from west.data.packing import pack_slots
from west.data.records import Record, Sample
from west.data.stats import DataStats
from west.data.tokenize import Encoded
from west.shapes import SpeechShape

if TYPE_CHECKING:   # the config module checks its keys against this one's names
    from west.data.config import DataConfig


class BatchPolicy:
    """Base: padded collation, no per-sample budget."""

    size_key: ClassVar[str]   # the DataConfig key that sizes this mode's batches
    packs_rows: ClassVar[bool] = False   # rows concatenate utterances up to pack_tokens (cu_seqlens)

    def __init__(self, conf: DataConfig, pad_id: int, placeholder_id: int, shape: SpeechShape,
                 prefix: Sequence[int] = ()):
        self.conf, self.pad_id, self.placeholder_id, self.shape = conf, pad_id, placeholder_id, shape
        self.prefix = list(prefix)   # data.shared_prefix: ids a packed row holds once for its samples

    def sample_budget(self) -> Optional[int]:
        return None

    def group(self, lengths: np.ndarray, world_size: int,
              rng: Optional[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def collate(self, samples: list[Sample], stats: DataStats) -> Batch:
        """A planned batch of decoded samples; all of them bad -> the dummy batch (counted)."""
        if not samples:
            stats.event("dummy_batches")
            return self.dummy_batch()
        return self._layout(self._rows(samples, stats))

    def dummy_batch(self) -> Batch:
        dummy = dummy_sample(self.pad_id, self.placeholder_id, self.conf.num_mel_bins, self.shape)
        batch = self._layout([[dummy]])
        batch.keys = []
        batch.counters = {k: 0 for k in batch.counters}
        return batch

    def _rows(self, samples: list[Sample], stats: DataStats) -> list[list[Sample]]:
        """Which samples share a row (padded modes: one batch, one sample per row)."""
        return [samples]

    def _layout(self, rows: list[list[Sample]]) -> Batch:
        return collate_padded(rows[0], self.pad_id, self.conf.num_mel_bins)


class StaticPolicy(BatchPolicy):
    """``batch_size`` samples per batch, every row padded to the longest."""

    size_key = "batch_size"

    def group(self, lengths, world_size, rng):
        sizes = equalize_rounds(static_sizes(lengths.shape[0], self.conf.batch_size), world_size)
        return np.arange(lengths.shape[0]), sizes


class DynamicPolicy(BatchPolicy):
    """As many samples as fit ``max_tokens_in_batch`` counting padding, from sort windows."""

    size_key = "max_tokens_in_batch"

    def sample_budget(self) -> Optional[int]:
        return self.conf.max_tokens_in_batch

    def group(self, lengths, world_size, rng):
        # sorted windows give batches of similar lengths, and neighbouring batches (one
        # step) similar costs; the planner then shuffles the steps
        order = sort_in_windows(lengths, self.conf.sort_buffer)
        sizes = dynamic_sizes(lengths[order], self.conf.max_tokens_in_batch)
        return order, equalize_rounds(sizes, world_size)

    def _rows(self, samples, stats):
        if max(s.length for s in samples) * len(samples) > self.conf.max_tokens_in_batch:
            stats.event("plan_overflow", samples[0].src, "decoded lengths exceed the planned dynamic budget")
        return [samples]


class PackPolicy(BatchPolicy):
    """Rows of at most ``pack_tokens`` by bin packing, balanced over the ranks of a step."""

    size_key = "pack_tokens"
    packs_rows = True

    def __init__(self, conf: DataConfig, pad_id: int, placeholder_id: int, shape: SpeechShape,
                 prefix: Sequence[int] = ()):
        super().__init__(conf, pad_id, placeholder_id, shape, prefix)
        if len(self.prefix) >= conf.pack_tokens:
            raise ValueError(f"data.pack_tokens: {conf.pack_tokens} leaves no room after the shared prompt "
                             f"prefix of {len(self.prefix)} tokens (data.shared_prefix)")

    @property
    def capacity(self) -> int:
        """Tokens a row holds for its samples: pack_tokens less the prefix laid out once per row
        (a sample's length already leaves out its share of it)."""
        return self.conf.pack_tokens - len(self.prefix)

    def sample_budget(self) -> Optional[int]:
        return self.capacity

    def group(self, lengths, world_size, rng):
        c = self.conf
        slot, n_bins = pack_slots(lengths, self.capacity, c.pack_algorithm, world_size, c.pack_cost)
        order = np.argsort(slot, kind="stable")
        sizes = np.bincount(slot, minlength=n_bins).astype(np.int64)
        return _fill_empty_packs(order, sizes, world_size)

    def _rows(self, samples, stats):
        lengths = [s.length for s in samples]
        if sum(lengths) <= self.capacity:
            return [samples]
        stats.event("plan_overflow", samples[0].src,
                    f"decoded lengths {sum(lengths)} exceed pack_tokens; batch gets an extra row "
                    "(list durations are wrong: run tools/compute_lengths.py)")
        return [[samples[i] for i in b] for b in split_rows(lengths, self.capacity)]

    def _layout(self, rows):
        c = self.conf
        return collate_packed(rows, c.pack_tokens, self.pad_id, c.encoder_layout, c.num_mel_bins,
                              c.pack_pad_multiple, self.prefix)


def _fill_empty_packs(order: np.ndarray, sizes: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Give an empty pack one sample of the pack with the most samples (prefer its own step).
    Only tiny windows (fewer samples than ranks in a step) have empty packs."""
    if sizes.all() or world_size == 1:
        return order, sizes
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    packs = [list(order[bounds[b]:bounds[b + 1]]) for b in range(sizes.shape[0])]
    for s in range(0, len(packs), world_size):
        step = packs[s:s + world_size]
        for b, members in enumerate(step):
            if members:
                continue
            local = max(step, key=len)
            donor = local if len(local) >= 2 else max(packs, key=len)
            if len(donor) >= 2:
                step[b].append(donor.pop())
    flat = [i for p in packs for i in p]
    return np.asarray(flat, np.int64), np.asarray([len(p) for p in packs], np.int64)


POLICIES: dict[str, type[BatchPolicy]] = {"static": StaticPolicy, "dynamic": DynamicPolicy, "pack": PackPolicy}


def make_policy(conf: DataConfig, pad_id: int, placeholder_id: int, shape: SpeechShape,
                prefix: Sequence[int] = ()) -> BatchPolicy:
    """The policy of ``conf.batch_type``; ``prefix``: the prompt ids samples share (data.shared_prefix)."""
    if conf.batch_type not in POLICIES:
        raise ValueError(f"data.batch_type: must be one of {sorted(POLICIES)}, got {conf.batch_type!r}")
    return POLICIES[conf.batch_type](conf, pad_id, placeholder_id, shape, prefix)


# -- collation ----------------------------------------------------------------------

def _encoder_inputs(segments: list[np.ndarray], packed: bool, num_mel_bins: int) -> dict:
    """Feats of every speech segment, padded (N, Tmax, F) or concatenated (ΣT, F)."""
    if not segments:
        return {"feats": None, "feat_lens": None, "computed": 0}
    lens = np.array([s.shape[0] for s in segments], np.int64)
    if packed:
        cu = np.zeros(len(segments) + 1, np.int32)
        cu[1:] = np.cumsum(lens)
        return {"feats": torch.from_numpy(np.concatenate(segments, 0)), "feat_lens": torch.from_numpy(lens),
                "feat_cu_seqlens": torch.from_numpy(cu), "feat_max_len": int(lens.max()),
                "computed": int(lens.sum())}
    tmax = int(lens.max())
    feats = np.zeros((len(segments), tmax, num_mel_bins), np.float32)   # numpy: no torch thread pool per copy
    for i, s in enumerate(segments):
        feats[i, :s.shape[0]] = s
    return {"feats": torch.from_numpy(feats), "feat_lens": torch.from_numpy(lens),
            "computed": len(segments) * tmax}


def _transcripts(samples) -> list[list[int]]:
    """Transcript ids per speech segment, in segment order ([] where unknown)."""
    out = []
    for s in samples:
        t = s.enc.transcripts
        out += t if len(t) == len(s.enc.spans) else [[] for _ in s.enc.spans]
    return out


def _ctc_inputs(transcripts: list[list[int]]) -> dict:
    if not transcripts:
        return {}
    flat = [t for ts in transcripts for t in ts]
    return {"ctc_targets": torch.tensor(flat, dtype=torch.long),
            "ctc_target_lens": torch.tensor([len(t) for t in transcripts], dtype=torch.long)}


def _finish(ids, labels, pos, segments, spans, keys, packed_enc, num_mel_bins, transcripts=(),
            **extra) -> Batch:
    enc = _encoder_inputs(segments, packed_enc, num_mel_bins)
    computed_enc = enc.pop("computed")
    counters = {
        "utterances": len(keys),
        "label_tokens": int((labels != IGNORE_INDEX).sum()),
        "real_llm_tokens": extra.pop("real_tokens"),
        "computed_llm_tokens": int(ids.size),
        "real_enc_frames": sum(s.shape[0] for s in segments),
        "computed_enc_frames": computed_enc,
    }
    assert tuple(counters) == COUNTER_NAMES
    if "attention_mask" in extra:
        extra["attention_mask"] = torch.from_numpy(extra["attention_mask"])
    span_t = torch.tensor(spans, dtype=torch.long).reshape(-1, 3) if spans else None
    return Batch(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels),
                 position_ids=torch.from_numpy(pos), speech_spans=span_t,
                 keys=list(keys), counters=counters, **enc, **_ctc_inputs(list(transcripts)), **extra)


def collate_padded(samples: Sequence[Sample], pad_id: int, num_mel_bins: int = 80) -> Batch:
    """Static/dynamic batch: (B, L) right padded, one sample per row."""
    lens = [len(s.enc.ids) for s in samples]
    b, width = len(samples), max(lens)
    ids = np.full((b, width), pad_id, np.int64)
    labels = np.full((b, width), IGNORE_INDEX, np.int64)
    mask = np.zeros((b, width), np.int64)
    segments, spans = [], []
    for r, s in enumerate(samples):
        n = lens[r]
        ids[r, :n] = s.enc.ids
        labels[r, :n] = s.enc.labels
        mask[r, :n] = 1
        for f, (start, length) in zip(s.feats, s.enc.spans):
            segments.append(f)
            spans.append((r, start, length))
    pos = np.tile(np.arange(width, dtype=np.int64), (b, 1))
    return _finish(ids, labels, pos, segments, spans, [s.key for s in samples], False, num_mel_bins,
                   _transcripts(samples), attention_mask=mask, real_tokens=sum(lens))


def pack_width(used: Sequence[int], pack_tokens: int, pad_multiple: int = 0) -> int:
    """Row width of a pack batch whose rows hold ``used`` tokens.

    A last, partial pack of an epoch would otherwise compute thousands of pad
    tokens; rounding to a multiple keeps the number of distinct shapes small."""
    if pad_multiple <= 0:
        return pack_tokens
    longest = max(used, default=0)
    return min(pack_tokens, max(pad_multiple, -(-longest // pad_multiple) * pad_multiple))


def collate_packed(rows: Sequence[Sequence[Sample]], pack_tokens: int, pad_id: int,
                   encoder_layout: str = "packed", num_mel_bins: int = 80, pad_multiple: int = 0,
                   prefix: Sequence[int] = ()) -> Batch:
    """Pack batch (one row unless a plan overflowed), each row ``pack_width`` tokens wide.

    ``prefix`` (data.shared_prefix): a row whose samples share it starts with it, once, as a
    segment of its own; those samples follow without it (positions going on from its length) and
    each attends to it through the key rows (``Batch.key_index``: the prefix's rows, then its own)."""
    n_rows, p = len(rows), len(prefix)
    opens = [p > 0 and any(s.enc.shared for s in row) for row in rows]   # the row starts with the prefix
    used = [p * o + sum(len(s.enc.ids) - (s.enc.shared if o else 0) for s in row) for row, o in zip(rows, opens)]
    pack_tokens = pack_width(used, pack_tokens, pad_multiple)
    ids = np.full((n_rows, pack_tokens), pad_id, np.int64)
    labels = np.full((n_rows, pack_tokens), IGNORE_INDEX, np.int64)
    pos = np.zeros((n_rows, pack_tokens), np.int64)
    cu, segments, spans, keys, key_rows, real = [0], [], [], [], [], 0
    for r, row in enumerate(rows):
        base, start = r * pack_tokens, 0
        if opens[r]:
            ids[r, :p], pos[r, :p] = prefix, np.arange(p)
            start = p
            cu.append(base + p)
            key_rows.append(np.arange(base, base + p))
        for s in row:
            shared = s.enc.shared if opens[r] else 0
            n = len(s.enc.ids) - shared
            if start + n > pack_tokens:
                raise ValueError(f"pack row {r} overflows {pack_tokens} tokens at sample {s.key}")
            ids[r, start:start + n] = s.enc.ids[shared:]
            labels[r, start:start + n] = s.enc.labels[shared:]
            pos[r, start:start + n] = np.arange(shared, shared + n)
            for f, (off, length) in zip(s.feats, s.enc.spans):
                segments.append(f)
                spans.append((r, start + off - shared, length))
            own = np.arange(base + start, base + start + n)
            key_rows.append(np.concatenate([np.arange(base, base + shared), own]) if shared else own)
            start += n
            cu.append(base + start)
            keys.append(s.key)
        real += start
        if start < pack_tokens:   # one dummy tail segment with consecutive positions
            pos[r, start:] = np.arange(pack_tokens - start)
            cu.append(base + pack_tokens)
            key_rows.append(np.arange(base + start, base + pack_tokens))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    return _finish(ids, labels, pos, segments, spans, keys, encoder_layout == "packed", num_mel_bins,
                   _transcripts([s for row in rows for s in row]), cu_seqlens=cu_t,
                   max_seqlen=int((cu_t[1:] - cu_t[:-1]).max()), real_tokens=real,
                   **(_key_layout(key_rows) if any(opens) else {}))


def _key_layout(key_rows: list[np.ndarray]) -> dict:
    """Batch.key_index / key_cu_seqlens / key_max_seqlen from each segment's key rows."""
    lens = np.array([k.size for k in key_rows], np.int64)
    return {"key_index": torch.from_numpy(np.concatenate(key_rows).astype(np.int64)),
            "key_cu_seqlens": torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)),
            "key_max_seqlen": int(lens.max())}


def dummy_sample(pad_id: int, placeholder_id: int, num_mel_bins: int, shape: SpeechShape) -> Sample:
    """One tiny sample (min-length all-zero speech + 2 pad tokens, all labels IGNORE): what a
    rank with nothing left trains on, so every rank runs forward/backward each step."""
    frames = shape.min_frames()
    n = shape.slots(frames)
    enc = Encoded(ids=[placeholder_id] * n + [pad_id] * 2, labels=[IGNORE_INDEX] * (n + 2), spans=[(0, n)])
    return Sample(Record(key="", src="dummy batch", audio=[]), feats=[np.zeros((frames, num_mel_bins), np.float32)],
                  enc=enc, length=len(enc.ids))
