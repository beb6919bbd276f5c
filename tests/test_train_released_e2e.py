"""What a new user runs with a released speech LLM (here tiny random ones written by save_pretrained:
Qwen2-Audio, Qwen3-ASR, and a full Qwen2.5-Omni with its talker and token2wav): west-train with the
model's recipe config (recipes/aishell/conf/*_lora.yaml) in pack mode, west-decode, west-export, the
export loaded back with transformers (LoRA merged, processor carried) and decoded by west to the same
hypotheses."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers.e2e import ROOT, read_jsonl, write_lists
from helpers.speech import tiny_qwen2_5_omni_dir, tiny_qwen2_audio_dir, tiny_qwen3_asr_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = ["--train.precision", "fp32", "--train.device", "cpu", "--train.nvml", "false", "--train.progress_bar", "false",
       "--train.tensorboard", "false", "--train.warmup_steps", "1", "--data.num_workers", "0",
       "--data.pin_memory", "false", "--model.llm.dtype", "float32", "--model.llm.gradient_checkpointing", "false",
       "--model.encoder.gradient_checkpointing", "false"]


def _released(kind: str, tmp_path: Path) -> str:
    if kind == "qwen2_audio":
        return tiny_qwen2_audio_dir(tmp_path / kind)
    if kind == "qwen3_asr":
        return tiny_qwen3_asr_dir(tmp_path / kind)
    return tiny_qwen2_5_omni_dir(tmp_path / kind, full=True)


def _check_export(kind: str, export: Path) -> None:
    """The export loads with the release's own class, every row present, its audio token and files kept."""
    import transformers

    cls = {"qwen2_audio": "Qwen2AudioForConditionalGeneration", "qwen3_asr": "Qwen3ASRForConditionalGeneration",
           "qwen2_5_omni": "Qwen2_5OmniThinkerForConditionalGeneration"}[kind]
    back, info = getattr(transformers, cls).from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"]
    if kind == "qwen3_asr":
        assert back.config.audio_token_id > 0
        assert transformers.AutoProcessor.from_pretrained(export).audio_token == "<|audio_pad|>"
    else:
        assert back.config.audio_token_index > 0 and (export / "tokenizer_config.json").is_file()
    if kind == "qwen2_5_omni":
        assert (export / "preprocessor_config.json").is_file()


@pytest.mark.parametrize("kind", ["qwen2_audio", "qwen3_asr", "qwen2_5_omni"])
def test_train_decode_export_reload(tmp_path, corpus, kind):
    from west.bin.decode import main as decode
    from west.bin.export import main as export
    from west.bin.train import main as train
    from west.checkpoint.integrity import find_latest
    from west.checkpoint.training import read_meta

    path = _released(kind, tmp_path)
    data = write_lists(corpus["rows"], tmp_path / "lists", 8).jsonl
    out = tmp_path / "run"
    conf = ROOT / "recipes" / "aishell" / "conf" / f"{kind}_lora.yaml"
    assert train(["--config", str(conf), "--model.path", path, "--train_data", str(data), "--output_dir", str(out),
                  "--batch_type", "pack", "--pack_tokens", "2048", "--max_steps", "2", *CPU]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["encoder"]["type"] == kind and saved["model"]["llm"]["path"] == path
    projector = {"qwen3_asr": {"type": "mlp", "stride": 1, "hidden_dim": 32}}.get(kind, {"type": "linear", "stride": 1})
    assert saved["model"]["projector"] == {**saved["model"]["projector"], **projector}
    steps = [r for r in read_jsonl(out / "train_log.jsonl") if r.get("status") == "ok"]
    assert len(steps) == 2 and all(r["utterances"] == 8 for r in steps)
    # lean: the frozen language model is referred to (the release dir, by path and SHA-256), not stored
    meta = read_meta(find_latest(out / "checkpoints"))
    assert meta["base_llm"]["path"] == str(Path(path).resolve()) and len(meta["base_llm"]["sha256"]) == 64

    result = tmp_path / "dec.jsonl"
    assert decode(["--checkpoint", str(out), "--data", str(data), "--result", str(result), "--batch_size", "4",
                   "--max_new_tokens", "3", "--device", "cpu", "--quiet"]) == 0
    assert len(read_jsonl(result)) == 8

    assert export(["--checkpoint", str(out), "--out", str(tmp_path / "export")]) == 0
    _check_export(kind, tmp_path / "export")
    # west decodes the released-format export too, to the same hypotheses (float32: LoRA merged exactly enough)
    again = tmp_path / "dec_export.jsonl"
    assert decode(["--checkpoint", str(tmp_path / "export"), "--data", str(data), "--result", str(again),
                   "--batch_size", "4", "--max_new_tokens", "3", "--device", "cpu", "--quiet"]) == 0
    assert [r["hyp"] for r in read_jsonl(again)] == [r["hyp"] for r in read_jsonl(result)]
