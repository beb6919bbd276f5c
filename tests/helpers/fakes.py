"""Fakes shared by the training tests: a position-wise token model, hand-built Batches
in padded and packed layouts, and a resumable in-memory data source.

The fake model follows the Batch/forward contract (labels already shifted, loss
summed over label positions), so the loop can be tested before west.models lands.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from west.batch import IGNORE_INDEX, Batch

from helpers.batches import packed_row, padded_rows

VOCAB = 13
PAD = 0


class TokenModel(nn.Module):
    """Embedding -> LayerNorm -> Linear: each position independent, so padding and
    packing cannot change its per-token losses."""

    def __init__(self, dim: int = 8, seed: int = 0, dropout: float = 0.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.drop = nn.Dropout(dropout)  # draws from the global RNG: resume must restore it
        self.emb = nn.Embedding(VOCAB, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.poison = False  # make the next forward's loss NaN (tests)

    def forward(self, batch: Batch) -> dict:
        logits = self.out(self.drop(self.norm(self.emb(batch.input_ids)))).float()
        labels = batch.labels
        loss_sum = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                               ignore_index=IGNORE_INDEX, reduction="sum")
        if self.poison or any(k.startswith("nan") for k in batch.keys):
            loss_sum = loss_sum * float("nan")
        mask = labels != IGNORE_INDEX
        n_correct = int(((logits.argmax(-1) == labels) & mask).sum())
        return {"loss_sum": loss_sum, "n_tokens": int(mask.sum()), "n_correct": n_correct}


def make_samples(n: int, seed: int = 0, prefix: str = "utt") -> list[tuple[str, list[int], list[int]]]:
    """(key, input_ids, labels) with varied lengths and label counts (labels already shifted)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 12, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        n_prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        labels = [IGNORE_INDEX] * n_prompt + ids[n_prompt + 1:] + [IGNORE_INDEX]
        out.append((f"{prefix}{i:04d}", ids, labels))
    return out


def _counters(samples, computed_tokens: int) -> dict:
    real = sum(len(s[1]) for s in samples)
    return {"utterances": len(samples), "label_tokens": sum(sum(l != IGNORE_INDEX for l in s[2]) for s in samples),
            "real_llm_tokens": real, "computed_llm_tokens": computed_tokens,
            "real_enc_frames": 0, "computed_enc_frames": 0}


def padded_batch(samples: Sequence) -> Batch:
    """static/dynamic layout: one sample per row, right padded."""
    R, L = len(samples), max(len(s[1]) for s in samples)
    return Batch(**padded_rows([(x, y) for _, x, y in samples], PAD), keys=[s[0] for s in samples],
                 counters=_counters(samples, R * L))


def packed_batch(samples: Sequence, pack_tokens: int) -> Batch:
    """pack layout: one row of exactly pack_tokens, a dummy tail segment if not full."""
    return Batch(**packed_row([(x, y) for _, x, y in samples], pack_tokens, PAD), keys=[s[0] for s in samples],
                 counters=_counters(samples, pack_tokens))


def dummy_batch() -> Batch:
    b = padded_batch([("", [1, 2], [IGNORE_INDEX, IGNORE_INDEX])])
    b.keys = []
    b.counters = {k: 0 for k in b.counters}
    return b


class SimulatedCrash(Exception):
    pass


class ListData:
    """A resumable per-rank data source over fixed batches (same order every epoch)."""

    def __init__(self, batches: list[Batch], kill_at: int = -1, crash_at: int = -1,
                 dummy: Callable[[], Batch] = dummy_batch, kill_note: Optional[Path] = None):
        self.batches, self.dummy_batch = batches, dummy
        self.kill_note = kill_note  # written just before the planned SIGKILL: any other death is not ours
        self.epoch = 0
        self.pos = 0
        self.kill_at = kill_at  # SIGKILL this process once this many batches were yielded in total
        self.crash_at = crash_at  # same, but raise SimulatedCrash (multi-rank tests)
        self.yielded = 0

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.pos = epoch, 0

    def __iter__(self) -> Iterator[Batch]:
        while self.pos < len(self.batches):
            if self.kill_at == self.yielded:
                if self.kill_note is not None:
                    self.kill_note.write_text(f"epoch {self.epoch}, {self.yielded} batches yielded")
                os.kill(os.getpid(), 9)
            if self.crash_at == self.yielded:
                raise SimulatedCrash(f"crash after {self.yielded} batches")
            b = self.batches[self.pos]
            self.pos += 1
            self.yielded += 1
            yield b

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = sd["epoch"], sd["pos"]

    def skipped_counts(self) -> dict:
        return {"too_long": 1}


def make_batches(n_batches: int, per_batch: int = 3, seed: int = 0, prefix: str = "utt") -> list[Batch]:
    """Alternating padded / packed batches of distinct samples."""
    samples = make_samples(n_batches * per_batch, seed=seed, prefix=prefix)
    out = []
    for i in range(n_batches):
        group = samples[i * per_batch:(i + 1) * per_batch]
        out.append(packed_batch(group, 40) if i % 2 else padded_batch(group))
    return out
