"""``west-export --checkpoint CKPT --out DIR``: a trained model as a self-contained directory.

DIR is what ``west-decode --checkpoint DIR`` loads (``west_model.json``, ``model.safetensors``
with the encoder, projector and CTC head, the run's ``config.yaml`` for its prompts), and
``DIR/llm`` is the LLM as a complete Hugging Face model with LoRA adapters merged into its
weights, plus the tokenizer: ``AutoModelForCausalLM.from_pretrained("DIR/llm")`` needs
neither west nor peft. CKPT is a training checkpoint (lean or full), a run dir (its latest
checkpoint) or an earlier export.

A run that started from a released speech LLM (``model.type qwen2_audio``) is written back in
that model's own format instead: DIR is what ``Qwen2AudioForConditionalGeneration.from_pretrained``
loads (west.checkpoint.released).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Sequence


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="west-export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint dir (DIR/checkpoints/step_N), a run DIR (its latest checkpoint) or an export")
    p.add_argument("--out", required=True, help="directory to write (must not hold another model)")
    p.add_argument("--config", help="the run's config.yaml (default: found next to the checkpoint)")
    p.add_argument("--llm_path", help="the base LLM dir, if it moved since training (default: the run's "
                                      "model.llm.path; its files must be the ones the checkpoint was trained on)")
    return p


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def export(checkpoint: str, out: str, config: str | None = None, llm_path: str | None = None) -> Path:
    """Load CKPT as west-decode does, merge the adapters, write DIR; returns DIR."""
    from west.checkpoint.pretrained import CONFIG_FILE, export_speech_llm  # heavy
    from west.checkpoint.restore import (  # heavy
        config_candidates,
        load_trained,
        read_run_config,
        released_type,
        resolve_checkpoint,
    )
    from west.models.encoders import exporter  # heavy

    ckpt = resolve_checkpoint(checkpoint)
    out_dir = Path(out)
    if out_dir.resolve() == ckpt.resolve():
        raise ValueError(f"--out {out}: is the checkpoint itself")
    earlier = (out_dir / CONFIG_FILE).is_file() or released_type(out_dir) is not None
    if out_dir.exists() and any(out_dir.iterdir()) and not earlier:
        raise FileExistsError(f"--out {out}: exists and is not an earlier export; give a new or empty dir")
    model, tokenizer = load_trained(ckpt, read_run_config(ckpt, config), llm_path)
    # a run that started from a released model goes back to that model's format (its registry entry)
    write = exporter(model.cfg.encoder.type) or export_speech_llm
    write(model.eval(), out_dir, tokenizer)
    for c in config_candidates(ckpt, config):
        if c.is_file():  # west-decode builds its prompts from the run's data section
            shutil.copy(c, out_dir / "config.yaml")
            break
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.config, args.llm_path)
    except (OSError, ValueError) as e:
        print(f"west-export: error: {e}", file=sys.stderr)
        return 2
    if not (out / "llm").is_dir():   # a released model's own format
        print(f"west-export: {out} ({_dir_size(out) / 1e6:.2f} MB), in the released model's format "
              "(from_pretrained with its transformers class)")
        return 0
    llm = _dir_size(out / "llm")
    print(f"west-export: {out} ({(_dir_size(out) - llm) / 1e6:.2f} MB speech side, "
          f"{llm / 1e6:.2f} MB LLM); west-decode --checkpoint {out}; "
          f"AutoModelForCausalLM.from_pretrained('{out / 'llm'}')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
