"""Lean checkpoints: the frozen base LLM referred to by path + SHA-256, LoRA adapters in peft's
format; round trip, refusals (other base bytes, other LoRA), full and older checkpoints still load."""
from __future__ import annotations

import json

import pytest
import torch

from west.checkpoint import training as ck
from west.checkpoint.base_llm import BaseLLM, base_llm_of
from west.models.config import LLMConfig
from west.models.llm import llm_fingerprint
from west.models.speech_llm import SpeechLLM
from west.train.schedule import build_optimizer, build_scheduler

from helpers.speech import lora_model, packed_batch, run, samples, tiny_config, write_base

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def frozen_model(base_dir, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config()
    cfg.llm, cfg.freeze_llm = LLMConfig(path=str(base_dir)), True
    return SpeechLLM(cfg).eval()


def trained(model):
    opt = build_optimizer(model, 1e-2, 0.1)
    sched = build_scheduler(opt, 2, 10)
    run(model, [packed_batch(samples()[:3], 96)])
    opt.step()
    sched.step()
    return model, opt, sched


def save(root, model, opt, sched, base):
    return ck.save_checkpoint(root, 3, model=model, optimizer=opt, scheduler=sched, data_state={"pos": 3},
                              meta={"epoch": 0}, base=base)


def load(path, model, base):
    opt = build_optimizer(model, 1e-2, 0.1)
    sched = build_scheduler(opt, 2, 10)
    return ck.load_checkpoint(path, model=model, optimizer=opt, scheduler=sched, base=base), opt


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("bases")
    return write_base(d / "base"), write_base(d / "other", seed=1)


def test_lean_lora_checkpoint_round_trip(bases, tmp_path):
    base_dir, _ = bases
    model, opt, sched = trained(lora_model(llm_path=base_dir))
    base = base_llm_of(model)
    assert base == BaseLLM(str(base_dir))
    path = save(tmp_path, model, opt, sched, base)
    from safetensors.torch import load_file

    stored = load_file(path / "model.safetensors")
    assert stored and not any(k.startswith("llm.") for k in stored)  # the LLM's trainables are the adapters
    adapter = load_file(path / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k and ".default" not in k for k in adapter)
    conf = json.loads((path / "adapter" / "adapter_config.json").read_text())
    assert (conf["r"], conf["lora_alpha"], conf["peft_type"]) == (4, 8, "LORA")
    meta = ck.read_meta(path)
    assert meta["model_state"] == {"llm": "referenced"}
    assert meta["base_llm"]["sha256"] == llm_fingerprint(base_dir)["sha256"]
    assert meta["base_llm"]["path"] == str(base_dir.resolve()) and meta["lora"]["r"] == 4
    assert set(stored) == {k for k in model.state_dict() if not k.startswith("llm.")}
    assert len(adapter) == sum("lora_" in k for k in model.state_dict())

    fresh = lora_model(seed=5, llm_path=base_dir)
    meta, opt2 = load(path, fresh, base_llm_of(fresh))
    assert meta["step"] == 3
    a, b = model.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)


def test_other_base_llm_bytes_are_refused_naming_both(bases, tmp_path):
    base_dir, other = bases
    model, opt, sched = trained(frozen_model(base_dir))
    path = save(tmp_path, model, opt, sched, base_llm_of(model))
    with pytest.raises(ck.CheckpointError) as e:
        load(path, frozen_model(other), base_llm_of(frozen_model(other)))
    msg = str(e.value)
    want = [str(base_dir.resolve()), str(other.resolve()), llm_fingerprint(base_dir)["sha256"],
            llm_fingerprint(other)["sha256"], "model.llm.path"]
    assert all(w in msg for w in want), msg
    with pytest.raises(ck.CheckpointError, match="does not hold the frozen base LLM"):
        load(path, frozen_model(base_dir), None)


def test_lora_resume_needs_the_same_lora(bases, tmp_path):
    base_dir, _ = bases
    model, opt, sched = trained(lora_model(llm_path=base_dir))
    path = save(tmp_path, model, opt, sched, base_llm_of(model))
    plain = frozen_model(base_dir)
    with pytest.raises(ck.CheckpointError, match=r"trained with LoRA r=4.*no model.lora.*--model.lora"):
        load(path, plain, base_llm_of(plain))
    from west.models.config import LoraSettings

    torch.manual_seed(0)
    cfg = tiny_config(lora=LoraSettings(r=2, alpha=8, dropout=0.0, target_modules=["q_proj"]))
    cfg.llm = LLMConfig(path=str(base_dir))
    other = SpeechLLM(cfg)
    with pytest.raises(ck.CheckpointError, match=r"model.lora.r differs \(the adapter matrices.*target_modules differs"):
        load(path, other, base_llm_of(other))
    path2 = save(tmp_path / "plain", *trained(frozen_model(base_dir)), base_llm_of(plain))
    with pytest.raises(ck.CheckpointError, match="trained without LoRA"):
        load(path2, lora_model(llm_path=base_dir), BaseLLM(str(base_dir)))


def test_full_and_older_checkpoints_still_load(bases, tmp_path):
    """train.save_frozen_llm: true keeps the whole LLM; a checkpoint written before lean ones
    existed (no model_state in meta.json) loads into a model built on the base."""
    base_dir, _ = bases
    model, opt, sched = trained(frozen_model(base_dir))
    path = save(tmp_path, model, opt, sched, None)
    from safetensors.torch import load_file

    assert any(k.startswith("llm.model.layers") for k in load_file(path / "model.safetensors"))
    meta = ck.read_meta(path)
    assert meta["model_state"] == {"llm": "included"} and "base_llm" not in meta
    del meta["model_state"]
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "checksums.json").unlink()  # nor checksums: those came later
    fresh = frozen_model(base_dir, seed=3)
    load(path, fresh, base_llm_of(fresh))
    a, b = model.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
