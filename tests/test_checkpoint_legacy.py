"""Files written by an older west (tests/fixtures/checkpoints_v1, see its README) load with today's
west.checkpoint: every format gives the loss its writer computed on the same batch."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from west.checkpoint import training
from west.checkpoint.base_llm import BaseLLM
from west.checkpoint.integrity import find_latest
from west.checkpoint.pretrained import load_speech_llm, save_speech_llm
from west.checkpoint.restore import load_trained
from west.models.config import SpeechLLMConfig
from west.models.speech_llm import SpeechLLM
from west.models.tiny_llm import build_tokenizer
from west.train.schedule import build_optimizer, build_scheduler

from helpers.speech import packed_batch, samples

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoints_v1"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())["losses"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def loss(model: SpeechLLM) -> float:
    with torch.no_grad():
        return float(model.eval()(packed_batch(samples()[:4], 128))["loss_sum"])


@pytest.fixture()
def fixture_dir(tmp_path) -> Path:
    """A copy: loading must not need the writer's paths, and must not write into the repo."""
    shutil.copytree(FIXTURE, tmp_path / "v1")
    # decoding loads the base's tokenizer; its files are not part of the fingerprint
    build_tokenizer(["a tiny corpus"], tmp_path / "v1" / "base", vocab_size=300)
    return tmp_path / "v1"


def test_lean_lora_training_checkpoint_resumes_and_decodes(fixture_dir):
    ckpt = find_latest(fixture_dir / "lean_lora")
    meta = training.read_meta(ckpt)
    assert meta["base_llm"]["path"] != str((fixture_dir / "base").resolve())  # the base moved since
    model, tokenizer = load_trained(ckpt, {}, llm_path=str(fixture_dir / "base"))  # west-decode's route
    assert tokenizer is not None and loss(model) == pytest.approx(EXPECTED["lean_lora"], rel=1e-6)

    cfg = SpeechLLMConfig.from_dict(meta["model"])  # resume: the trainer's path
    cfg.llm.path = str(fixture_dir / "base")
    resumed = SpeechLLM(cfg)
    opt = build_optimizer(resumed, 1e-2, 0.1)
    sched = build_scheduler(opt, 2, 10)
    got = training.load_checkpoint(ckpt, model=resumed, optimizer=opt, scheduler=sched,
                                   base=BaseLLM(str(fixture_dir / "base")))
    assert got["data_state"] == {"pos": 3} and sched.last_epoch == 1
    assert loss(resumed) == pytest.approx(EXPECTED["lean_lora"], rel=1e-6)


def test_full_tied_training_checkpoint_resumes(fixture_dir):
    ckpt = find_latest(fixture_dir / "full_tied")
    meta = training.read_meta(ckpt)
    assert meta["model_state"] == {"llm": "included"}
    model = SpeechLLM(SpeechLLMConfig.from_dict(meta["model"]))
    emb = model.llm.get_input_embeddings().weight
    assert emb is model.llm.get_output_embeddings().weight  # tied in this model
    opt = build_optimizer(model, 1e-2, 0.1)
    training.load_checkpoint(ckpt, model=model, optimizer=opt, scheduler=build_scheduler(opt, 2, 10))
    assert loss(model) == pytest.approx(EXPECTED["full_tied"], rel=1e-6)


@pytest.mark.parametrize("name", ["pretrained_included", "pretrained_path", "export"])
def test_pretrained_dirs_load(fixture_dir, name):
    llm_path = str(fixture_dir / "base") if name == "pretrained_path" else None
    if name == "pretrained_path":  # written without a fingerprint: loads, says it could not check
        with pytest.warns(UserWarning, match="without the base LLM's fingerprint"):
            model = load_speech_llm(fixture_dir / name, llm_path=llm_path)
    else:
        model = load_speech_llm(fixture_dir / name)
    assert loss(model) == pytest.approx(EXPECTED[name], rel=1e-6)


def test_saving_again_records_the_base_and_refuses_another(fixture_dir, tmp_path):
    """The "path" mode goes: saving the same model now writes the fingerprint, which a different
    base LLM then fails, naming the key."""
    with pytest.warns(UserWarning):
        model = load_speech_llm(fixture_dir / "pretrained_path", llm_path=str(fixture_dir / "base"))
    save_speech_llm(model, tmp_path / "again", include_frozen_llm=False)
    back = load_speech_llm(tmp_path / "again")
    assert loss(back) == pytest.approx(EXPECTED["pretrained_path"], rel=1e-6)

    other = tmp_path / "other_base"
    shutil.copytree(fixture_dir / "base", other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    from west.checkpoint.base_llm import LeanError

    with pytest.raises(LeanError, match="model.llm.path"):
        load_speech_llm(tmp_path / "again", llm_path=str(other))
