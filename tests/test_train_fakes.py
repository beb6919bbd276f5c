"""Fakes shared by the training tests: a position-wise token model, hand-built Batches
in padded and packed layouts, and a resumable in-memory data source.

The fake model follows the Batch/forward contract (labels already shifted, loss
summed over label positions), so the loop can be tested before west.models lands.
"""
from __future__ import annotations

import multiprocessing
import os
import socket
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from west.batch import IGNORE_INDEX, Batch

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
    L = max(len(s[1]) for s in samples)
    R = len(samples)
    ids = torch.full((R, L), PAD, dtype=torch.long)
    labels = torch.full((R, L), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((R, L), dtype=torch.long)
    for r, (_, x, y) in enumerate(samples):
        ids[r, :len(x)] = torch.tensor(x)
        labels[r, :len(y)] = torch.tensor(y)
        mask[r, :len(x)] = 1
    pos = torch.arange(L).expand(R, L).clone()
    return Batch(ids, labels, pos, attention_mask=mask, keys=[s[0] for s in samples],
                 counters=_counters(samples, R * L))


def packed_batch(samples: Sequence, pack_tokens: int) -> Batch:
    """pack layout: one row of exactly pack_tokens, a dummy tail segment if not full."""
    ids, labels, pos, cu = [], [], [], [0]
    for _, x, y in samples:
        ids += x
        labels += y
        pos += list(range(len(x)))
        cu.append(len(ids))
    tail = pack_tokens - len(ids)
    assert tail >= 0
    if tail:
        ids += [PAD] * tail
        labels += [IGNORE_INDEX] * tail
        pos += list(range(tail))
        cu.append(pack_tokens)
    seg = [b - a for a, b in zip(cu, cu[1:])]
    return Batch(torch.tensor([ids]), torch.tensor([labels]), torch.tensor([pos]),
                 cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(seg),
                 keys=[s[0] for s in samples], counters=_counters(samples, pack_tokens))


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
                 dummy: Callable[[], Batch] = dummy_batch):
        self.batches, self.dummy_batch = batches, dummy
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


# Forking is fast (the child imports nothing again), but once this process has run a backward
# pass on a machine with a GPU, autograd's device threads make a forked child fail on its first
# backward: there children are spawned (fresh interpreters; targets must be module-level).
START_METHOD = "spawn" if torch.cuda.is_available() else "fork"


def run_child(target: Callable, *args) -> int:
    """``target(*args)`` in one child process (START_METHOD); its exit code (-9: killed by SIGKILL)."""
    child = multiprocessing.get_context(START_METHOD).Process(target=target, args=args)
    child.start()
    child.join()
    return child.exitcode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60) -> None:
    """torchrun-style env for spawned test workers, then west's own init."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    from west.train.distributed import init_distributed

    return init_distributed("cpu", timeout_s=timeout_s)


def make_batches(n_batches: int, per_batch: int = 3, seed: int = 0, prefix: str = "utt") -> list[Batch]:
    """Alternating padded / packed batches of distinct samples."""
    samples = make_samples(n_batches * per_batch, seed=seed, prefix=prefix)
    out = []
    for i in range(n_batches):
        group = samples[i * per_batch:(i + 1) * per_batch]
        out.append(packed_batch(group, 40) if i % 2 else padded_batch(group))
    return out
