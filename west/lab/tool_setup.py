"""What the step-diagnosis tools share (tools/count_syncs.py, tools/profile_step.py): the same N
utterances, the model of a config, and each batch mode's batches as the production step gets them."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from west.batch import Batch
from west.bench.benchmark import load_batches
from west.bench.modes import Mode, select_utterances, standard_modes
from west.bench.runner import PassRunner
from west.config import load_config, split_overrides
from west.models.llm import load_tokenizer
from west.ranks import resolved_device
from west.train.build import build_model
from west.train.encoder_graphs import resolve_encoder_graphs


def add_setup_args(p: argparse.ArgumentParser, modes: str = "static,dynamic,pack,pack_encoder_padded") -> None:
    p.add_argument("--config", required=True)
    p.add_argument("--data", required=True, help="jsonl data list to draw the utterances from")
    p.add_argument("--num_utts", type=int, default=200)
    p.add_argument("--modes", default=modes)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--max_tokens_in_batch", type=int, default=4096)
    p.add_argument("--pack_tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)


@dataclass
class ToolSetup:
    cfg: object
    device: torch.device
    modes: list[Mode]
    subset: Path           # the N utterances every mode trains on
    tokenizer: object
    runner: PassRunner     # over the config's model

    def batches(self, mode: Mode, limit: Optional[int] = None) -> list[Batch]:
        """``mode``'s first ``limit`` batches of the subset, pinned on CUDA as the loader gives them."""
        conf = dataclasses.replace(self.cfg.data, **mode.data, num_workers=0)
        batches = load_batches(str(self.subset), self.tokenizer, conf, self.runner.model.cfg.speech_shape(),
                               self.runner.seed)[0][:limit]
        return [b.pin_memory() for b in batches] if self.device.type == "cuda" else batches


def tool_setup(args: argparse.Namespace, overrides: list[str], subset: Path) -> ToolSetup:
    """Config (with ``--section.key VALUE`` overrides), device, modes, the utterance subset written
    to ``subset``, tokenizer and a PassRunner over the built model."""
    cfg = load_config(args.config, split_overrides(overrides))
    device = torch.device(resolved_device(cfg.train.device))
    note = resolve_encoder_graphs(cfg, device, 1)
    if note:
        print(note, flush=True)
    modes = standard_modes([m for m in args.modes.split(",") if m], args.batch_size, args.max_tokens_in_batch,
                           args.pack_tokens)
    select_utterances(args.data, args.num_utts, subset, args.seed)
    tokenizer = load_tokenizer(cfg.model.llm.path)
    model = build_model(cfg.model, args.seed).to(device)
    return ToolSetup(cfg, device, modes, subset, tokenizer, PassRunner(model, cfg.train, device, args.seed))
