"""The one way west refers to a frozen base LLM it did not store: path, prefix and fingerprint.

Training checkpoints (``meta.json`` ``"base_llm"``) and :mod:`west.checkpoint.pretrained`
directories (the safetensors metadata) record :meth:`BaseLLM.reference`: the absolute path, the
state-dict prefix and the SHA-256 of the files (west.models.llm.llm_fingerprint). Loading checks
the bytes under the path given now against it (:func:`check_base`), so a moved or replaced base
is refused with the key to set, never loaded silently.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from torch import nn

from west.models.llm import llm_fingerprint
from west.ranks import unwrap

CONFIG_KEY = "model.llm.path"


class LeanError(ValueError):
    """A checkpoint that does not fit this run's model (message names the key to fix)."""


@dataclass(frozen=True)
class BaseLLM:
    """The frozen base LLM of a run: loaded from ``path``, its parameters under ``prefix``."""

    path: str
    prefix: str = "llm."

    def reference(self) -> dict:
        """What meta.json records: absolute path, prefix and the fingerprint of the files."""
        return {"path": str(Path(self.path).resolve()), "prefix": self.prefix, **llm_fingerprint(self.path)}


def base_llm_of(model: nn.Module) -> Optional[BaseLLM]:
    """The base a SpeechLLM-like model (``cfg.llm.path`` + ``llm`` attribute) loaded its LLM
    from, when some of that LLM is frozen; None otherwise (nothing could be left out)."""
    cfg = getattr(getattr(unwrap(model), "cfg", None), "llm", None)
    if cfg is None or not getattr(cfg, "path", None):
        return None
    base = BaseLLM(cfg.path)
    return base if frozen_names(model, base.prefix) else None


def frozen_names(model: nn.Module, prefix: str) -> set[str]:
    """State-dict names under ``prefix`` that are frozen parameters (tied aliases included)."""
    module = unwrap(model)
    return {n for n, p in module.named_parameters(remove_duplicate=False)
            if n.startswith(prefix) and not p.requires_grad}


def check_base(ckpt: Path, meta: dict, base: Optional[BaseLLM]) -> None:
    """A lean checkpoint needs the very base LLM it was trained on (same file bytes)."""
    ref = meta.get("base_llm")
    if not ref:
        return
    if base is None:
        raise LeanError(f"{ckpt} does not hold the frozen base LLM; it refers to {ref['path']} "
                        f"(sha256 {ref['sha256'][:16]}...): set {CONFIG_KEY} to that directory (and keep the "
                        "LLM frozen as in training)")
    if not Path(base.path).is_dir():
        raise LeanError(f"{CONFIG_KEY} {base.path!r} is not a directory; {ckpt} was trained on {ref['path']}")
    now = llm_fingerprint(base.path)
    if now["sha256"] != ref["sha256"]:
        raise LeanError(f"{ckpt} was trained on the base LLM {ref['path']} (sha256 {ref['sha256']}), but "
                        f"{CONFIG_KEY} is {str(Path(base.path).resolve())} (sha256 {now['sha256']}): other "
                        f"weights or config. Set {CONFIG_KEY} (west-decode / west-export: --llm_path) to "
                        "the LLM the checkpoint was trained on.")
