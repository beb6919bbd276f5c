"""Assemble one training run from a resolved Config: tokenizer, model, this rank's data, Trainer.

This is the only place that joins west.data and west.models; ``west-train``
calls :func:`train` after the config was checked and saved.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from west.checkpoint.base_llm import frozen_names
from west.checkpoint.model_state import state_bytes
from west.config import Config
from west.data.dataset import build_dataloader
from west.host_memory import keep_freed_host_memory
from west.models.config import SpeechLLMConfig
from west.models.llm import load_tokenizer
from west.models.speech_llm import SpeechLLM
from west.train.distributed import DistInfo, cleanup, init_distributed
from west.train.encoder_graphs import describe_shape, resolve_encoder_graphs
from west.train.evaluate import build_evaluator
from west.train.loop import StepObserver, Trainer
from west.train.preempt import shield_loader_workers
from west.train.schedule import describe_groups


def build_model(model_cfg: SpeechLLMConfig, seed: int) -> SpeechLLM:
    """Same seed on every rank (DDP also broadcasts rank 0's weights when wrapping); the
    encoder then takes ``model.encoder.init``'s weights when given (a resume overwrites them)."""
    torch.manual_seed(seed)
    model = SpeechLLM(model_cfg)
    if model_cfg.encoder.init:
        load_encoder_init(model, model_cfg.encoder.init)
    return model


def load_encoder_init(model: SpeechLLM, path: str) -> None:
    """Strict load of an encoder state dict (west names) into ``model.encoder``."""
    from safetensors.torch import load_file  # heavy

    try:
        model.encoder.load_state_dict(load_file(path), strict=True)
    except RuntimeError as e:
        raise ValueError(f"model.encoder.init {path}: does not fit model.encoder ({str(e).splitlines()[0]} "
                         "...); use the encoder section written next to it (encoder.yaml)") from None


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    return total, sum(p.numel() for p in model.parameters() if p.requires_grad)


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def checkpoint_line(model: torch.nn.Module, base, save_frozen_llm: bool) -> str:
    """What every checkpoint of this run will weigh: model weights (+ adapters) and AdamW's two
    moments per trainable value, and whether the frozen base LLM is in it or referred to."""
    frozen_set = frozen_names(model, base.prefix) if base is not None else set()
    frozen = state_bytes(model, set()) - state_bytes(model, frozen_set)
    weights = state_bytes(model, set() if save_frozen_llm else frozen_set)
    optim = 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if base is None:
        how = "the whole model (no frozen LLM loaded from model.llm.path)"
    elif save_frozen_llm:
        how = f"the frozen LLM ({_mb(frozen)}) included (train.save_frozen_llm: true)"
    else:
        how = f"trainable weights + buffers; the frozen base LLM ({_mb(frozen)}) referred to by path: {base.path}"
    return f"checkpoint: {_mb(weights + optim)} per save (weights {_mb(weights)} + optimizer {_mb(optim)}), {how}"


def setup_logging(rank: int) -> None:
    """Rank 0 shows the data pipeline's INFO lines (epoch summaries); other ranks warnings only."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")


def build_trainer(cfg: Config, info: DistInfo, observers: Sequence[StepObserver] = ()) -> Trainer:
    """Tokenizer, model, this rank's share of the data (and of the dev list); nothing is trained yet."""
    tokenizer = load_tokenizer(cfg.model.llm.path)
    model = build_model(cfg.model, cfg.train.seed)
    shape = cfg.model.speech_shape()
    loader, dataset = build_dataloader(cfg.run.train_data, tokenizer, cfg.data, shape, info.rank,
                                       info.world_size, seed=cfg.train.seed, epoch=0, training=True)
    shield_loader_workers(loader, cfg.train.preempt_signals)
    evaluator = build_evaluator(cfg, tokenizer, shape, info)
    if info.is_main:
        total, trainable = count_params(model)
        print(f"model: {total / 1e6:.2f} M parameters, {trainable / 1e6:.2f} M trainable; "
              f"data: {cfg.data.batch_type} batches, {len(dataset)} batches per epoch per rank (planned); "
              f"{info.world_size} rank(s) on {info.device.type}", flush=True)
    note = resolve_encoder_graphs(cfg, info.device, info.world_size)
    if note and info.is_main:
        print(note, flush=True)
    trainer = Trainer(cfg.train, cfg.run, model, loader, info, evaluator, pack_tokens=cfg.data.pack_tokens,
                      observers=observers)
    if info.is_main:
        print(describe_groups(model, trainer.optimizer, cfg.train.projector_warmup_steps), flush=True)
        print(checkpoint_line(model, trainer.base, cfg.train.save_frozen_llm), flush=True)
        if trainer.encoder_static is not None:
            print(describe_shape(trainer.encoder_static.shape, trainer.encoder_shape_note), flush=True)
    return trainer


def train(cfg: Config, observers: Sequence[StepObserver] = ()) -> dict:
    """Join the process group (if launched by torchrun), build, fit; returns the loop's summary."""
    info = init_distributed(cfg.train.device, cfg.train.dist_timeout_s)
    setup_logging(info.rank)
    if info.device.type == "cpu":
        note = keep_freed_host_memory()
        if info.is_main:
            print(note, flush=True)
    try:
        return build_trainer(cfg, info, observers).fit()
    finally:
        cleanup()
