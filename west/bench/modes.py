"""The batch modes a benchmark compares, and the utterances every mode trains on."""
from __future__ import annotations

import json
import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

DEFAULT_MODES = ("static", "dynamic", "pack", "pack_encoder_padded")
WHISPER_PADDED = "whisper_padded_30s"   # added for an encoder with a 30 s window: what users run today
ALL_MODES = DEFAULT_MODES + ("pack_nf", "pack_shared_prefix")   # every mode any encoder runs


@dataclass(frozen=True)
class Mode:
    name: str
    method: str          # first column of the seed table
    configuration: str   # second column
    data: dict = field(default_factory=dict)   # DataConfig overrides
    model: dict = field(default_factory=dict)  # model attributes set for this mode's passes ("encoder.x")


def standard_modes(names: Sequence[str] = DEFAULT_MODES, batch_size: int = 32, max_tokens: int = 4096,
                   pack_tokens: int = 8192, encoder_title: str = "Whisper") -> list[Mode]:
    """The seed table's modes plus the ablations, sized like the seed experiment by default
    (``encoder_title`` names the encoder in the padded-to-30 s row)."""
    pack = dict(batch_type="pack", pack_tokens=pack_tokens, pack_algorithm="bfd", encoder_layout="packed",
                shared_prefix=False)
    table = {
        "static": Mode("static", "static batch", f"batch size {batch_size}",
                       dict(batch_type="static", batch_size=batch_size, shared_prefix=False)),
        "dynamic": Mode("dynamic", "dynamic batch", f"max token in batch {max_tokens}",
                        dict(batch_type="dynamic", max_tokens_in_batch=max_tokens, shared_prefix=False)),
        "pack": Mode("pack", "sequence pack", f"pack token {pack_tokens}, encoder packed", pack),
        "pack_encoder_padded": Mode("pack_encoder_padded", "pack, encoder padded (WEST)",
                                    f"pack token {pack_tokens}, encoder padded",
                                    {**pack, "encoder_layout": "padded"}),
        "pack_nf": Mode("pack_nf", "sequence pack, next-fit", f"pack token {pack_tokens}, next-fit",
                        {**pack, "pack_algorithm": "nf"}),
        "pack_shared_prefix": Mode("pack_shared_prefix", "sequence pack, shared prompt prefix",
                                   f"pack token {pack_tokens}, the prompt's prefix once per pack",
                                   {**pack, "shared_prefix": True}),
        WHISPER_PADDED: Mode(WHISPER_PADDED, f"{encoder_title} padded to 30 s", f"batch size {batch_size}, every "
                             "utterance's encoder input padded to 30 s",
                             dict(batch_type="static", batch_size=batch_size, shared_prefix=False),
                             {"encoder.pad_to_30s": True}),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown benchmark mode(s) {unknown}; choose from {list(table)}")
    return [table[n] for n in names]


@contextmanager
def model_overrides(model, attrs: dict):
    """Set ``attrs`` ("child.attr": value) on ``model`` for the block, then restore them."""
    saved = []
    try:
        for dotted, value in attrs.items():
            owner_path, name = dotted.rsplit(".", 1)
            owner = model.get_submodule(owner_path)
            if not hasattr(owner, name):
                raise ValueError(f"mode sets {dotted}, which {type(owner).__name__} does not have")
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        yield model
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def select_utterances(data_list: str, n: int, out_path: Path, seed: int = 0) -> list[str]:
    """Write a jsonl list of ``n`` utterances drawn (seeded) from ``data_list``; returns their keys."""
    lines = [ln for ln in Path(data_list).read_text(encoding="utf-8").splitlines() if ln.strip()]
    keys = []
    for i, ln in enumerate(lines):
        try:
            keys.append(json.loads(ln)["key"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{data_list}:{i + 1}: the benchmark needs a jsonl list with a 'key' "
                             "per line (tools/prepare_aishell.py --jsonl writes one)") from None
    if n <= 0 or n > len(lines):
        raise ValueError(f"--num_utts {n}: {data_list} has {len(lines)} utterances")
    chosen = sorted(random.Random(seed).sample(range(len(lines)), n))
    out_path.write_text("".join(lines[i] + "\n" for i in chosen), encoding="utf-8")
    return [keys[i] for i in chosen]
