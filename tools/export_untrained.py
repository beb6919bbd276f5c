#!/usr/bin/env python3
"""Recipe stage 6: save the untrained (step-0) model of a run, the baseline its CER is compared with.

It is what west-train starts from: the same config, the same build function, the same seed.
The run's config.yaml is copied next to the export so west-decode prompts it the same way.

    python tools/export_untrained.py exp/tiny_cpu/config.yaml exp/tiny_cpu/untrained_init
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from west.checkpoint.pretrained import save_speech_llm
from west.config import load_config
from west.models.llm import load_tokenizer
from west.train.build import build_model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="the run's resolved DIR/config.yaml")
    p.add_argument("out", help="export dir (west.checkpoint.pretrained.save_speech_llm)")
    a = p.parse_args(argv)
    cfg = load_config(a.config)
    model = build_model(cfg.model, cfg.train.seed)
    save_speech_llm(model, a.out, tokenizer=load_tokenizer(cfg.model.llm.path))
    shutil.copy(a.config, Path(a.out) / "config.yaml")


if __name__ == "__main__":
    main()
