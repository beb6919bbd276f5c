"""Decoded samples -> ``west.batch.Batch`` (the contract with the model).

* ``collate_padded``: static/dynamic; one sample per row, right padded,
  attention_mask, positions 0..L-1 (pads continue counting), encoder feats
  padded (N, Tmax, F).
* ``collate_packed``: pack; rows of at most ``pack_tokens`` (all rows of a batch
  as wide as its longest row, rounded up to ``pad_multiple``; 0 = exactly
  ``pack_tokens``, for fixed shapes); positions restart
  per sample; a non-full row ends with ONE dummy segment (pad ids, positions
  0..tail-1, no labels) so flash-attn varlen never sees a run of position-0
  tokens; explicit ``cu_seqlens``/``max_seqlen``; encoder feats concatenated
  (ΣT, F) with ``feat_cu_seqlens`` or, for the ablation, padded.
* ``dummy_sample``: what a rank trains on when its planned samples were all bad
  (each batching policy collates it its own way).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from west.batch import COUNTER_NAMES, IGNORE_INDEX, Batch
from west.data.tokenize import Encoded
from west.shapes import SpeechShape


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
        t = s["enc"].transcripts
        out += t if len(t) == len(s["enc"].spans) else [[] for _ in s["enc"].spans]
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


def collate_padded(samples: Sequence[dict], pad_id: int, num_mel_bins: int = 80) -> Batch:
    """Static/dynamic batch: (B, L) right padded, one sample per row."""
    lens = [len(s["enc"].ids) for s in samples]
    b, width = len(samples), max(lens)
    ids = np.full((b, width), pad_id, np.int64)
    labels = np.full((b, width), IGNORE_INDEX, np.int64)
    mask = np.zeros((b, width), np.int64)
    segments, spans = [], []
    for r, s in enumerate(samples):
        n = lens[r]
        ids[r, :n] = s["enc"].ids
        labels[r, :n] = s["enc"].labels
        mask[r, :n] = 1
        for f, (start, length) in zip(s["feats"], s["enc"].spans):
            segments.append(f)
            spans.append((r, start, length))
    pos = np.tile(np.arange(width, dtype=np.int64), (b, 1))
    return _finish(ids, labels, pos, segments, spans, [s["key"] for s in samples], False, num_mel_bins,
                   _transcripts(samples), attention_mask=mask, real_tokens=sum(lens))


def pack_width(used: Sequence[int], pack_tokens: int, pad_multiple: int = 0) -> int:
    """Row width of a pack batch whose rows hold ``used`` tokens.

    A last, partial pack of an epoch would otherwise compute thousands of pad
    tokens; rounding to a multiple keeps the number of distinct shapes small."""
    if pad_multiple <= 0:
        return pack_tokens
    longest = max(used, default=0)
    return min(pack_tokens, max(pad_multiple, -(-longest // pad_multiple) * pad_multiple))


def collate_packed(rows: Sequence[Sequence[dict]], pack_tokens: int, pad_id: int,
                   encoder_layout: str = "packed", num_mel_bins: int = 80, pad_multiple: int = 0) -> Batch:
    """Pack batch (one row unless a plan overflowed), each row ``pack_width`` tokens wide."""
    n_rows = len(rows)
    pack_tokens = pack_width([sum(len(s["enc"].ids) for s in row) for row in rows], pack_tokens, pad_multiple)
    ids = np.full((n_rows, pack_tokens), pad_id, np.int64)
    labels = np.full((n_rows, pack_tokens), IGNORE_INDEX, np.int64)
    pos = np.zeros((n_rows, pack_tokens), np.int64)
    cu, segments, spans, keys, real = [0], [], [], [], 0
    for r, row in enumerate(rows):
        start = 0
        for s in row:
            n = len(s["enc"].ids)
            if start + n > pack_tokens:
                raise ValueError(f"pack row {r} overflows {pack_tokens} tokens at sample {s['key']}")
            ids[r, start:start + n] = s["enc"].ids
            labels[r, start:start + n] = s["enc"].labels
            pos[r, start:start + n] = np.arange(n)
            for f, (off, length) in zip(s["feats"], s["enc"].spans):
                segments.append(f)
                spans.append((r, start + off, length))
            start += n
            cu.append(r * pack_tokens + start)
            keys.append(s["key"])
        real += start
        if start < pack_tokens:   # one dummy tail segment with consecutive positions
            pos[r, start:] = np.arange(pack_tokens - start)
            cu.append((r + 1) * pack_tokens)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    return _finish(ids, labels, pos, segments, spans, keys, encoder_layout == "packed", num_mel_bins,
                   _transcripts([s for row in rows for s in row]), cu_seqlens=cu_t,
                   max_seqlen=int((cu_t[1:] - cu_t[:-1]).max()), real_tokens=real)


def dummy_sample(pad_id: int, placeholder_id: int, num_mel_bins: int, shape: SpeechShape) -> dict:
    """One tiny sample (min-length all-zero speech + 2 pad tokens, all labels IGNORE): what a
    rank with nothing left trains on, so every rank runs forward/backward each step."""
    frames = shape.min_frames()
    n = shape.slots(frames)
    enc = Encoded(ids=[placeholder_id] * n + [pad_id] * 2, labels=[IGNORE_INDEX] * (n + 2), spans=[(0, n)])
    return {"key": "", "enc": enc, "feats": [np.zeros((frames, num_mel_bins), np.float32)]}
