"""Dev evaluation during training: the training loss over a dev list, and greedy CER/WER.

Loss: the objective of a training step, Σ loss_sum / Σ label tokens, over the WHOLE dev
list in the training batch mode. The dev loader is planned like a training epoch without
shuffling, dither or SpecAugment, so every utterance is on exactly one rank; the sums go
through one all-reduce. Every rank runs as many forwards as the rank with the most
batches (the others feed the dataset's dummy batch: zero loss, zero tokens), since
DDP/FSDP forwards are collectives.

Decoding (``train.eval_decode_utts`` > 0): greedy search over the first N dev records,
record i on rank i % W; every rank calls ``generate`` as often as the busiest one (a
dummy prompt fills in) with ``synced_gpus`` so FSDP ranks gather weights together.
Edit distances and reference lengths are summed over ranks: CER always, WER too when
the references are space-delimited (no CJK text), both after ``train.eval_normalizer``
(west.infer.scoring) on the hypotheses and the references.

The evaluation is invisible to training: no_grad, ``eval()`` then back to ``train()``,
and the global RNG states (torch, CUDA, numpy, python) are restored afterwards, so a
run's training losses are bit-identical with and without it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Iterator, Optional, Protocol

import torch
from torch import nn

from west.batch import Batch
from west.checkpoint.training import rng_state, set_rng_state
from west.data.dataset import build_dataloader
from west.data.generation import dummy_prompt_batch, prompt_batches
from west.data.stats import DataStats
from west.data.tokenize import pad_token_id
from west.infer.scoring import detect_mode, error_rate, get_normalizer
from west.ranks import all_reduce_max, all_reduce_sum, sum_counts_over_ranks, unwrap
from west.schema import ConfigError, require
from west.train.distributed import DistInfo
from west.train.preempt import shield_loader_workers
from west.train.step import AUX_KEYS, autocast

if TYPE_CHECKING:
    from west.config import Config
    from west.data.config import DataConfig
    from west.shapes import SpeechShape

DECODE_BATCH = 16  # prompts per generate() call


class DevLoss(Protocol):
    """This rank's dev batches in the training batch mode (the same ones on every pass)."""

    def __iter__(self) -> Iterator[Batch]: ...
    def __len__(self) -> int: ...
    def dummy_batch(self) -> Batch: ...
    def skipped_counts(self) -> dict: ...


class DevDecoder(Protocol):
    """This rank's share of the utterances to decode, and how to read the output."""

    def prompts(self) -> Iterator[tuple[Batch, list[str]]]: ...   # (prompt batch, reference texts)
    def dummy_prompt(self) -> Batch: ...
    def text(self, ids: list[int]) -> str: ...
    def generate_kwargs(self) -> dict: ...                        # eos / pad ids


class Evaluator:
    """Runs one dev evaluation on every rank; returns the global figures (same on all ranks)."""

    def __init__(self, dev: DevLoss, decoder: Optional[DevDecoder], info: DistInfo, *,
                 precision: str = "fp32", max_new_tokens: int = 64, normalizer: str = "none") -> None:
        self.dev, self.decoder, self.info = dev, decoder, info
        self.precision, self.max_new_tokens = precision, max_new_tokens
        self.normalize = get_normalizer(normalizer)   # a missing library fails here, not at the first evaluation
        self._fsdp_registered = False

    def evaluate(self, model: nn.Module) -> dict:
        """``{cv_loss, cv_acc, cv_tokens, cv_utts, [cv_ce], [cv_cer, [cv_wer]], cv_decoded_utts,
        cv_skipped_inputs, eval_s}``; collective."""
        t0 = time.perf_counter()
        rng, was_training = rng_state(), model.training
        model.eval()
        try:
            with torch.no_grad():
                rec = self._loss(model)
                rec.update(self._decode(model) if self.decoder is not None else {"cv_decoded_utts": 0})
        finally:
            model.train(was_training)
            set_rng_state(rng)
        rec["eval_s"] = round(time.perf_counter() - t0, 3)
        return rec

    # ------------------------------------------------------------------ loss

    def _loss(self, model: nn.Module) -> dict:
        n_local = len(self.dev)
        n_max = int(all_reduce_max([n_local])[0])
        loss_sum, sums = 0.0, [0, 0, 0]   # loss (float64), then correct, tokens, utterances
        aux = [0.0] * len(AUX_KEYS)
        it, exhausted = iter(self.dev), False
        for _ in range(n_max):
            batch = None if exhausted else next(it, None)
            exhausted = batch is None
            batch = batch if batch is not None else self.dev.dummy_batch()
            with autocast(self.info.device, self.precision):
                out = model(batch.to(self.info.device))
            loss_sum += float(out["loss_sum"].detach().double())
            sums[0] += int(out["n_correct"])
            sums[1] += int(out["n_tokens"])
            sums[2] += int(batch.counters.get("utterances", len(batch.keys)))
            for j, key in enumerate(AUX_KEYS):
                aux[j] += float(out.get(key, 0.0))
            del out
        if not exhausted:   # let the loader finish its pass (skip counts, summary)
            extra = sum(1 for _ in it)
            assert extra == 0, f"the dev loader yielded {extra} batch(es) more than its planned {n_local}"
        total = all_reduce_sum([loss_sum, *sums, *aux])
        loss, correct, tokens, utts = total[0], int(total[1]), int(total[2]), int(total[3])
        g_aux = dict(zip(AUX_KEYS, total[4:]))
        rec = {"cv_loss": _div(loss, tokens), "cv_acc": _div(correct, tokens), "cv_tokens": tokens,
               "cv_utts": utts}
        if g_aux["ctc_utts"]:   # hybrid CTC: the cross-entropy part alone, per token
            rec["cv_ce"] = _div(g_aux["ce_sum"], tokens)
        rec["cv_skipped_inputs"] = sum_counts_over_ranks(self.dev.skipped_counts())
        return rec

    # ------------------------------------------------------------------ decoding

    def _generator(self, model: nn.Module) -> nn.Module:
        """The module whose ``generate`` to call: DDP's inner module; FSDP2's root, made to
        gather its weights for ``generate`` as it does for ``forward``."""
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method  # heavy

        if isinstance(model, FSDPModule) and not self._fsdp_registered:
            register_fsdp_forward_method(model, "generate")
            self._fsdp_registered = True
        return unwrap(model)

    def _decode(self, model: nn.Module) -> dict:
        dec = self.decoder
        gen = self._generator(model)
        batches = list(dec.prompts())
        n_max = int(all_reduce_max([len(batches)])[0])
        kwargs = dict(dec.generate_kwargs(), max_new_tokens=self.max_new_tokens, num_beams=1)
        if self.info.world_size > 1:
            kwargs["synced_gpus"] = True   # ranks finish at different lengths: keep stepping together
        refs, hyps = {}, {}
        for i in range(n_max):
            batch, texts = batches[i] if i < len(batches) else (dec.dummy_prompt(), [])
            with autocast(self.info.device, self.precision):   # as the dev loss (FSDP bf16 weights)
                ids = gen.generate(batch.to(self.info.device), **kwargs)
            for row, ref in zip(ids, texts):
                key = str(len(refs))
                refs[key], hyps[key] = ref, dec.text(row)
        refs = {k: self.normalize(v) for k, v in refs.items()}
        hyps = {k: self.normalize(v) for k, v in hyps.items()}
        cer, wer = error_rate(refs, hyps, "cer"), error_rate(refs, hyps, "wer")
        cjk = bool(refs) and detect_mode(refs) == "cer"
        total = all_reduce_sum([cer.errors, cer.ref_tokens, wer.errors, wer.ref_tokens, len(refs), cjk])
        rec = {"cv_cer": _div(total[0], total[1])}
        if total[5] == 0:   # no CJK reference anywhere: words are space-delimited
            rec["cv_wer"] = _div(total[2], total[3])
        rec["cv_decoded_utts"] = int(total[4])
        return rec


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


# ----------------------------------------------------------------------------- west.data adapters

class LoaderDevLoss:
    """:class:`DevLoss` over west.data's planned loader (epoch 0, no shuffle)."""

    def __init__(self, loader, dataset) -> None:
        self.loader, self.dataset = loader, dataset
        loader.generator = torch.Generator().manual_seed(0)  # no draw from the global RNG

    def __iter__(self) -> Iterator[Batch]:
        yield from self.loader
        self.dataset.warn_limit = 0   # each bad record was named once; later passes only count

    def __len__(self) -> int:
        return len(self.dataset)

    def dummy_batch(self) -> Batch:
        return self.dataset.dummy_batch()

    def skipped_counts(self) -> dict:
        return self.dataset.stats.as_dict()


class PromptDecoder:
    """:class:`DevDecoder` over west.data.generation: this rank's records among the first ``n``."""

    def __init__(self, data_list: str, tokenizer, conf: DataConfig, shape: SpeechShape, n: int,
                 info: DistInfo) -> None:
        self.args = (data_list, tokenizer, conf, shape)
        self.n, self.info, self.tokenizer = n, info, tokenizer

    def prompts(self) -> Iterator[tuple[Batch, list[str]]]:
        stats = DataStats(max_warnings=0)  # the loss pass already counted and reported bad records
        return prompt_batches(*self.args, DECODE_BATCH, stats, limit=self.n, rank=self.info.rank,
                              world_size=self.info.world_size)

    def dummy_prompt(self) -> Batch:
        _, tokenizer, conf, shape = self.args
        return dummy_prompt_batch(tokenizer, conf, shape)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def generate_kwargs(self) -> dict:
        return {"eos_token_id": self.tokenizer.eos_token_id, "pad_token_id": pad_token_id(self.tokenizer)}


def build_evaluator(cfg: Config, tokenizer, shape: SpeechShape, info: DistInfo) -> Optional[Evaluator]:
    """The run's evaluator (None without ``run.cv_data``).

    The dev list uses the data section as it is (batch mode and sizes of training) without
    the train lists' weights. A list left with no usable utterance is a ConfigError."""
    if not cfg.run.cv_data:
        return None
    try:
        get_normalizer(cfg.train.eval_normalizer)
    except ValueError as e:   # its library is missing
        raise ConfigError(f"train.eval_normalizer: {e}") from None
    conf = dataclasses.replace(cfg.data, weights=None)
    loader, dataset = build_dataloader(cfg.run.cv_data, tokenizer, conf, shape, info.rank, info.world_size,
                                       seed=cfg.train.seed, epoch=0, training=False)
    shield_loader_workers(loader, cfg.train.preempt_signals)  # a preemption must not kill them mid-evaluation
    usable = sum(len(e) for e in dataset.eligible)
    skipped = [s.summary(p) for p, s in dataset.list_skips if s.skipped]
    require(usable > 0, "run.cv_data", f"no usable utterance in {cfg.run.cv_data}"
            + (f" ({'; '.join(skipped)})" if skipped else " (every one filtered by length)"))
    t = cfg.train
    decoder = PromptDecoder(cfg.run.cv_data, tokenizer, conf, shape, t.eval_decode_utts, info) \
        if t.eval_decode_utts > 0 else None
    return Evaluator(LoaderDevLoss(loader, dataset), decoder, info, precision=t.precision,
                     max_new_tokens=t.eval_max_new_tokens, normalizer=t.eval_normalizer)
