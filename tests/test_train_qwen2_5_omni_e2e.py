"""What a new user runs with a released Qwen2.5-Omni (here a tiny random full model, talker and
token2wav included, written by save_pretrained): west-train with
recipes/aishell/conf/qwen2_5_omni_lora.yaml in pack mode, west-decode, west-export, and the export
(the thinker alone) loaded back with transformers and decoded by west."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers.e2e import ROOT, read_jsonl, write_lists
from helpers.speech import tiny_qwen2_5_omni_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONF = ROOT / "recipes" / "aishell" / "conf" / "qwen2_5_omni_lora.yaml"
CPU = ["--train.precision", "fp32", "--train.device", "cpu", "--train.nvml", "false", "--train.progress_bar", "false",
       "--train.tensorboard", "false", "--train.warmup_steps", "1", "--data.num_workers", "0",
       "--data.pin_memory", "false", "--model.llm.dtype", "float32", "--model.llm.gradient_checkpointing", "false",
       "--model.encoder.gradient_checkpointing", "false"]


def test_train_decode_export_reload(tmp_path, corpus):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    from west.bin.decode import main as decode
    from west.bin.export import main as export
    from west.bin.train import main as train
    from west.checkpoint.integrity import find_latest
    from west.checkpoint.training import read_meta

    omni = tiny_qwen2_5_omni_dir(tmp_path / "omni", full=True)
    data = write_lists(corpus["rows"], tmp_path / "lists", 8).jsonl
    out = tmp_path / "run"
    assert train(["--config", str(CONF), "--model.path", omni, "--train_data", str(data), "--output_dir", str(out),
                  "--batch_type", "pack", "--pack_tokens", "2048", "--max_steps", "2", *CPU]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["encoder"]["type"] == "qwen2_5_omni" and saved["model"]["llm"]["path"] == omni
    steps = [r for r in read_jsonl(out / "train_log.jsonl") if r.get("status") == "ok"]
    assert len(steps) == 2 and all(r["utterances"] == 8 for r in steps)
    # lean: the frozen language model is referred to (the release dir, by path and SHA-256), not stored
    meta = read_meta(find_latest(out / "checkpoints"))
    assert meta["base_llm"]["path"] == str(Path(omni).resolve()) and len(meta["base_llm"]["sha256"]) == 64

    result = tmp_path / "dec.jsonl"
    assert decode(["--checkpoint", str(out), "--data", str(data), "--result", str(result), "--batch_size", "4",
                   "--max_new_tokens", "3", "--device", "cpu", "--quiet"]) == 0
    assert len(read_jsonl(result)) == 8

    assert export(["--checkpoint", str(out), "--out", str(tmp_path / "export")]) == 0
    back, info = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tmp_path / "export",
                                                                            output_loading_info=True)
    assert not info["missing_keys"] and back.config.audio_token_index > 0
    assert (tmp_path / "export" / "preprocessor_config.json").is_file()
    # west decodes the released-format export too, to the same hypotheses (float32: LoRA merged exactly enough)
    again = tmp_path / "dec_export.jsonl"
    assert decode(["--checkpoint", str(tmp_path / "export"), "--data", str(data), "--result", str(again),
                   "--batch_size", "4", "--max_new_tokens", "3", "--device", "cpu", "--quiet"]) == 0
    assert [r["hyp"] for r in read_jsonl(again)] == [r["hyp"] for r in read_jsonl(result)]
