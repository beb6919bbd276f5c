"""Prompt-only batches for decoding, built on the training feature path.

Records go through the same stages as in training (audio, features: fbank + CMVN or whisper; no
dither, SpecAugment or duration filter since ``training=False``), then
``PromptEncoder.encode_prompt`` renders the chat prompt up to the assistant
header with ``SpeechShape.slots(T)`` placeholders per audio part. Batches are
right padded like static batches (``collate_padded``, labels all IGNORE);
``SpeechLLM.generate`` moves the padding to the left itself. Bad utterances are
skipped and counted in ``stats`` like in training; list order is kept.
"""
from __future__ import annotations

from itertools import islice
from typing import Iterable, Iterator, Optional

from west.batch import IGNORE_INDEX, Batch
from west.data.config import DataConfig, for_shape
from west.data.features import GlobalCMVN
from west.data.lists import iter_records
from west.data.policies import collate_padded, dummy_sample
from west.data.processors import FEATURE_STAGES, DecodeContext, load_audio
from west.data.records import Sample
from west.data.stats import DataStats, SkipSample
from west.data.tokenize import Encoded, PromptEncoder
from west.shapes import SpeechShape


def tokenize_prompt(samples: Iterable[Sample], encoder: PromptEncoder, stats: DataStats) -> Iterator[Sample]:
    """Prompt ids + speech spans (no transcript, no labels) and the reference text."""
    for s in samples:
        try:
            ids, spans = encoder.encode_prompt(s.record, [f.shape[0] for f in s.feats])
        except SkipSample as e:
            stats.skip(e.category, f"{s.src} (key {s.key})", e.message)
            continue
        s.enc = Encoded(ids=ids, labels=[IGNORE_INDEX] * len(ids), spans=spans)
        s.length, s.ref = len(ids), s.record.reference()
        yield s


def prompt_batches(data_list: str, tokenizer, conf: DataConfig, shape: SpeechShape, batch_size: int,
                   stats: DataStats, *, limit: Optional[int] = None, rank: int = 0,
                   world_size: int = 1) -> Iterator[tuple[Batch, list[str]]]:
    """(padded prompt Batch, reference texts) of up to ``batch_size`` utterances, in list order.

    ``limit``/``rank``/``world_size`` pick a shard of the list's first ``limit`` records
    (record i goes to rank i % world_size), so dev decoding splits over ranks."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    conf = for_shape(conf, shape)
    encoder = PromptEncoder(tokenizer, conf, shape)
    ctx = DecodeContext(conf, encoder, stats, GlobalCMVN.from_json(conf.cmvn) if conf.cmvn else None,
                        training=False)
    stream: Iterable = islice(iter_records(data_list, stats, conf.data_type, conf), rank, limit, world_size)
    for stage in (load_audio, *FEATURE_STAGES[conf.features]):
        stream = stage(stream, ctx)
    group: list[Sample] = []
    for sample in tokenize_prompt(stream, encoder, stats):
        group.append(sample)
        if len(group) == batch_size:
            yield collate_padded(group, encoder.pad_id, conf.num_mel_bins), [s.ref for s in group]
            group = []
    if group:
        yield collate_padded(group, encoder.pad_id, conf.num_mel_bins), [s.ref for s in group]


def dummy_prompt_batch(tokenizer, conf: DataConfig, shape: SpeechShape) -> Batch:
    """A one-row prompt of minimal silent speech: what a rank with nothing left to decode feeds
    ``generate`` so that every rank calls it equally often (FSDP gathers weights per call)."""
    conf = for_shape(conf, shape)
    encoder = PromptEncoder(tokenizer, conf, shape)
    return collate_padded([dummy_sample(encoder.pad_id, encoder.placeholder_id, conf.num_mel_bins, shape)],
                          encoder.pad_id, conf.num_mel_bins)
