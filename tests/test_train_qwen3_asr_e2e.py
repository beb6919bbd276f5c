"""What a new user runs with a released Qwen3-ASR (here a tiny random one written by save_pretrained):
west-train with recipes/aishell/conf/qwen3_asr_lora.yaml in pack mode, west-decode, west-export, the
export loaded back with transformers (LoRA merged, processor carried) and decoded by west."""
from __future__ import annotations

import pytest
import yaml

from helpers.e2e import ROOT, read_jsonl, write_lists
from helpers.speech import tiny_qwen3_asr_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONF = ROOT / "recipes" / "aishell" / "conf" / "qwen3_asr_lora.yaml"
CPU = ["--train.precision", "fp32", "--train.device", "cpu", "--train.nvml", "false", "--train.progress_bar", "false",
       "--train.tensorboard", "false", "--train.warmup_steps", "1", "--data.num_workers", "0",
       "--data.pin_memory", "false", "--model.llm.dtype", "float32", "--model.llm.gradient_checkpointing", "false",
       "--model.encoder.gradient_checkpointing", "false"]


def test_train_decode_export_reload(tmp_path, corpus):
    from transformers import AutoProcessor, Qwen3ASRForConditionalGeneration

    from west.bin.decode import main as decode
    from west.bin.export import main as export
    from west.bin.train import main as train

    q3 = tiny_qwen3_asr_dir(tmp_path / "q3asr")
    data = write_lists(corpus["rows"], tmp_path / "lists", 8).jsonl
    out = tmp_path / "run"
    assert train(["--config", str(CONF), "--model.path", q3, "--train_data", str(data), "--output_dir", str(out),
                  "--batch_type", "pack", "--pack_tokens", "2048", "--max_steps", "2", *CPU]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["encoder"]["type"] == "qwen3_asr" and saved["model"]["llm"]["path"] == q3
    assert saved["model"]["projector"] == {**saved["model"]["projector"], "type": "mlp", "stride": 1, "hidden_dim": 32}
    steps = [r for r in read_jsonl(out / "train_log.jsonl") if r.get("status") == "ok"]
    assert len(steps) == 2 and all(r["utterances"] == 8 for r in steps)

    result = tmp_path / "dec.jsonl"
    assert decode(["--checkpoint", str(out), "--data", str(data), "--result", str(result), "--batch_size", "4",
                   "--max_new_tokens", "3", "--device", "cpu", "--quiet"]) == 0
    assert len(read_jsonl(result)) == 8

    assert export(["--checkpoint", str(out), "--out", str(tmp_path / "export")]) == 0
    back = Qwen3ASRForConditionalGeneration.from_pretrained(tmp_path / "export")
    assert back.config.audio_token_id > 0
    assert AutoProcessor.from_pretrained(tmp_path / "export").audio_token == "<|audio_pad|>"
    # west decodes the released-format export too, to the same hypotheses (float32: LoRA merged exactly enough)
    again = tmp_path / "dec_export.jsonl"
    assert decode(["--checkpoint", str(tmp_path / "export"), "--data", str(data), "--result", str(again),
                   "--batch_size", "4", "--max_new_tokens", "3", "--device", "cpu", "--quiet"]) == 0
    assert [r["hyp"] for r in read_jsonl(again)] == [r["hyp"] for r in read_jsonl(result)]
