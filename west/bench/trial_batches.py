"""Any mode's batches at any size, from utterances decoded once; and the batches a memory trial runs.

A memory trial needs the batches one size produces, not the loader's time. Planning is from
lengths (cheap) and decoding (audio, features, tokens) is the same in every mode and at every
size (a sample's random draws depend on its key, seed and epoch only), so each utterance is
decoded once and every (mode, size) is planned and collated from the cache, exactly as the
training loader would plan and collate it (``SpeechDataset``'s plan, the policy's collate).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from west.batch import Batch
from west.data.config import DataConfig
from west.data.dataset import SpeechDataset
from west.data.processors import DecodeContext, decode
from west.data.stats import DataStats
from west.shapes import SpeechShape


class BatchSource:
    """The benchmark's utterance list, decoded on first use and kept."""

    def __init__(self, data_list: str, tokenizer, shape: SpeechShape, seed: int = 0):
        self.data_list, self.tokenizer, self.shape, self.seed = data_list, tokenizer, shape, seed
        self._samples: dict[str, dict] = {}

    def dataset(self, conf: DataConfig) -> SpeechDataset:
        """The training dataset of ``conf`` (epoch 0, one rank): its plan, lengths and policy."""
        conf = dataclasses.replace(conf, num_workers=0)
        return SpeechDataset(self.data_list, self.tokenizer, conf, self.shape, seed=self.seed, epoch=0, training=True)

    def batches(self, conf: DataConfig) -> list[Batch]:
        """Every batch of epoch 0 in mode ``conf``, collated (undecodable utterances skipped, as the loader does)."""
        ds = self.dataset(conf)
        stats = DataStats(conf.max_warnings)
        ctx = DecodeContext(ds.conf, ds.encoder, stats, ds.cmvn, True, self.seed, 0, budget=None)
        out = []
        for ids in ds.rank_batches():
            records = [ds.record(int(i)) for i in ids]
            new = [r for r in records if r.key not in self._samples]
            for s in decode(iter(new), ctx):
                self._samples[s.key] = s
            out.append(ds.policy.collate([self._samples[r.key] for r in records if r.key in self._samples],
                                         stats))
        return out


def size_bounds(source: BatchSource, conf: DataConfig, key: str) -> tuple[int, int]:
    """(smallest, largest) sensible value of the size ``key`` for these utterances: a token budget
    must hold the longest utterance (else it would be skipped, and the modes would train on
    different utterances) and need not exceed one batch of all of them; a batch size lies in [1, N]."""
    ds = source.dataset(dataclasses.replace(conf, batch_type="static", batch_size=1))   # no token budget
    lengths = ds.lengths[np.concatenate(ds.rank_batches())]
    n, longest = int(lengths.shape[0]), int(lengths.max())
    if key == "batch_size":
        return 1, n
    if key == "max_tokens_in_batch":     # counts padding: every row as long as the longest
        return longest, n * longest
    return longest, int(lengths.sum()) + conf.pack_pad_multiple


def llm_attention(b: Batch) -> int:
    """Σ len² the LLM's attention computes: rows · width² padded, Σ segment² packed."""
    if b.is_packed:
        cu = b.cu_seqlens.long().tolist()
        return sum((e - s) ** 2 for s, e in zip(cu, cu[1:]))
    rows, width = b.input_ids.shape
    return int(rows) * int(width) ** 2


def encoder_attention(b: Batch) -> int:
    """N · (longest fbank length)²: the scores a padded encoder, or a packed one in one attention
    group (the Conformer's on CUDA), materialises; grows with the longest utterance, not Σ len."""
    if b.feat_lens is None or b.feat_lens.numel() == 0:
        return 0
    return int(b.feat_lens.numel()) * int(b.feat_lens.max()) ** 2


WORST_BY = {
    "computed_llm_tokens": lambda b: b.counters["computed_llm_tokens"],
    "llm_attention": llm_attention,
    "computed_enc_frames": lambda b: b.counters["computed_enc_frames"],
    "encoder_attention": encoder_attention,
}


def worst_batches(batches: Sequence[Batch]) -> list[int]:
    """Indices of the batches that maximise what a step's activation memory grows with: the LLM
    positions computed, the LLM attention terms (quadratic where a kernel materialises scores),
    the encoder frames computed and the encoder's attention scores. One batch when one is the
    largest on all four."""
    picked: list[int] = []
    for cost in WORST_BY.values():
        i = max(range(len(batches)), key=lambda j: cost(batches[j]))
        if i not in picked:
            picked.append(i)
    return picked
