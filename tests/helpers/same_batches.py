"""One data set in two list kinds must give the same epoch: helpers shared by the tests of the
Lhotse and Hugging Face list kinds (each compared with the same utterances as a jsonl list)."""
from __future__ import annotations

import dataclasses

import torch

from west.data.config import DataConfig
from west.data.dataset import build_dataloader
from west.shapes import SpeechShape

SIZES = dict(batch_size=4, max_tokens_in_batch=300, pack_tokens=400)
MODES = ("static", "dynamic", "pack")


def run(path, tokenizer, shape: SpeechShape = SpeechShape(), rank=0, world_size=1, seed=3, epoch=1,
        training=True, **kw):
    """(batches, dataset) of one epoch; training with dither and SpecAugment, so features are compared
    with their per-sample randomness."""
    conf = DataConfig(**{**SIZES, "spec_aug": True, **kw})
    loader, ds = build_dataloader(str(path), tokenizer, conf, shape, rank, world_size, seed, epoch, training)
    return list(loader), ds


def assert_same_batches(got, want) -> None:
    """Batch for batch, field for field (keys, ids, labels, features, spans, counters...)."""
    assert [b.keys for b in got] == [b.keys for b in want]
    for a, b in zip(got, want):
        for f in dataclasses.fields(b):
            if f.name == "source":
                continue
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(y, torch.Tensor):
                assert isinstance(x, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f.name
            else:
                assert x == y, f.name


def keys(batches) -> list[str]:
    return [k for b in batches for k in b.keys]


def tiny_model(tokenizer):
    """A tiny SpeechLLM (eval mode) to turn batches into losses."""
    from west.models.config import LLMConfig, ProjectorConfig, SpeechLLMConfig
    from west.models.speech_llm import SpeechLLM

    from helpers.e2e import tiny_encoder

    torch.manual_seed(0)
    llm = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    cfg = SpeechLLMConfig(encoder=tiny_encoder(dropout=0.0), projector=ProjectorConfig(stride=2, hidden_dim=48),
                          llm=LLMConfig(config=llm), freeze_llm=False)
    return SpeechLLM(cfg).eval()


def loss(model, batches) -> tuple[float, int]:
    """(summed loss, label tokens) of an epoch's batches."""
    total, n = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            out = model(batch)
            total += float(out["loss_sum"])
            n += int(out["n_tokens"])
    return total, n
