"""LoRA as a tested path: exactness across batch modes, target errors, peft's adapter format,
the merged Hugging Face export, the base LLM's fingerprint. peft is imported, never skipped:
it is in the dev extra."""
from __future__ import annotations

import peft  # noqa: F401  (a missing peft fails here, loudly)
import pytest
import torch

from west.models.speech_llm import SpeechLLM

from helpers.speech import ALL_PROJ, assert_same, lora_model, packed_batch, padded_batch, run, samples, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_lora_static_dynamic_pack_agree_for_adapters_encoder_projector():
    model, ss = lora_model(), samples()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapters = {n for n in trainable if "lora_" in n}
    assert len(adapters) == 2 * 2 * len(ALL_PROJ)  # A and B, 2 layers, 7 projections
    assert {n.split(".")[0] for n in trainable} == {"encoder", "projector", "llm"}
    assert all("lora_" in n for n in trainable if n.startswith("llm."))
    total = sum(len(s.ids) for s in ss)
    single = run(model, [padded_batch([s]) for s in ss])
    assert set(single[3]) == trainable and all(single[3][n].abs().max() > 0 for n in adapters)
    for name, batches in {
        "static": [padded_batch(ss, extra_len=3, extra_frames=11)],
        "dynamic": [padded_batch([ss[1], ss[4]]), padded_batch([ss[0], ss[2], ss[3]], extra_len=1)],
        "pack": [packed_batch(ss, total + 6)],
        "two_packs": [packed_batch(ss[:2], 64), packed_batch(ss[2:], 64, encoder="padded")],
    }.items():
        assert_same(run(model, batches), single, name)


def test_unknown_lora_target_names_it_and_lists_candidates():
    with pytest.raises(ValueError) as e:
        lora_model(targets=["q_proj", "qkv_proj"])
    msg = str(e.value)
    assert "model.lora.target_modules" in msg and "'qkv_proj'" in msg and "'q_proj'" not in msg
    assert all(c in msg for c in ALL_PROJ + ["lm_head"])


def test_adapter_dir_is_peft_format_and_merged_export_matches(tmp_path):
    """save_adapter writes what PeftModel.from_pretrained reads; export_speech_llm's merged
    LLM (plain transformers) gives the logits of base + adapters, and the exported SpeechLLM
    the same loss."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from west.checkpoint.pretrained import export_speech_llm, load_speech_llm
    from west.models.llm import load_adapter, read_adapter_settings, save_adapter

    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    SpeechLLM(tiny_config()).llm.save_pretrained(base_dir)
    model = lora_model(llm_path=base_dir)
    adapters = {n: t for n, t in model.llm.state_dict().items() if "lora_" in n}
    save_adapter(model.llm, adapters, tmp_path / "adapter")
    assert read_adapter_settings(tmp_path / "adapter") == {"r": 4, "alpha": 8, "target_modules": sorted(ALL_PROJ)}
    back = load_adapter(model.llm, tmp_path / "adapter")
    assert back.keys() == adapters.keys() and all(torch.equal(back[n], adapters[n]) for n in adapters)

    ids = torch.randint(4, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.llm(input_ids=ids, use_cache=False).logits
        plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
        assert torch.allclose(plain(input_ids=ids).logits, ours, atol=1e-6)
        b = packed_batch(samples()[:3], 96)
        loss = model(b)["loss_sum"]
        export_speech_llm(model, tmp_path / "export")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "llm")
        assert not any("lora" in n for n in merged.state_dict())
        assert torch.allclose(merged(input_ids=ids).logits, ours, atol=1e-5)
        loaded = load_speech_llm(tmp_path / "export").eval()
        assert loaded.cfg.lora is None
        assert torch.allclose(loaded(b)["loss_sum"], loss, rtol=1e-5)


def test_fingerprint_follows_the_bytes_and_is_computed_once(tmp_path, monkeypatch):
    import hashlib

    from west.models import llm as llm_mod

    torch.manual_seed(0)
    SpeechLLM(tiny_config()).llm.save_pretrained(tmp_path / "a")
    (tmp_path / "a" / "tokenizer.json").write_text("{}")  # tokenizer files are not hashed
    first = llm_mod.llm_fingerprint(tmp_path / "a")
    assert first["files"] == ["config.json", "model.safetensors"] and first["bytes"] > 0
    calls, real = [], hashlib.sha256
    monkeypatch.setattr(llm_mod.hashlib, "sha256", lambda: calls.append(1) or real())
    assert llm_mod.llm_fingerprint(tmp_path / "a") == first and not calls  # cached
    torch.manual_seed(1)
    SpeechLLM(tiny_config()).llm.save_pretrained(tmp_path / "a")  # other weights, same names
    assert llm_mod.llm_fingerprint(tmp_path / "a")["sha256"] != first["sha256"] and calls
