"""Controls for pretrained parts: frozen encoder blocks, per-module learning rates, and a
projector-only warm-up during which AdamW moves nothing else (bitwise, weight decay on), on
the tiny random SpeechLLM; a run resumed in the middle of the warm-up is bit-exact."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from west.models.config import SpeechLLMConfig
from west.models.speech_llm import SpeechLLM
from west.schema import ConfigError
from west.train.config import RunConfig, TrainConfig
from west.train.distributed import DistInfo
from west.train.loop import Trainer
from west.train.schedule import describe_groups, module_of, optimizer_from_config, scheduler_from_config, warmup_cosine
from west.train.step import plan_step, train_step

from helpers.fakes import ListData, TokenModel
from helpers.speech import padded_batch, samples, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")


def model(seed: int = 0, **kw) -> SpeechLLM:
    torch.manual_seed(seed)
    return SpeechLLM(tiny_config(ctc_weight=0.3, **kw))


def batches() -> list:
    s = samples()
    return [padded_batch(s[0:2]), padded_batch(s[2:4]), padded_batch(s[3:5]), padded_batch([s[0], s[4]])]


def train_cfg(**kw) -> TrainConfig:
    base = dict(lr=1e-3, warmup_steps=2, max_steps=8, max_epochs=0, weight_decay=0.1, grad_clip=1.0,
                tensorboard=False, progress_bar=False, log_every=1000, nvml=False, save_at_epoch_end=False)
    return TrainConfig(**{**base, **kw})


def steps(m: SpeechLLM, cfg: TrainConfig, n: int, on_step=None):
    """``n`` optimizer steps over the fixed batches (one batch per step) with the run's optimizer
    and schedule; ``on_step(step, optimizer)`` sees the gradients before each update."""
    opt = optimizer_from_config(m, cfg)
    sched = scheduler_from_config(opt, cfg, cfg.max_steps)
    if on_step:
        opt.register_step_pre_hook(lambda o, a, k: on_step(sched.last_epoch, o))
    data = batches()
    for i in range(n):
        b = [data[i % len(data)]]
        assert train_step(m, b, plan_step(b, 1), opt, sched, device=CPU, world_size=1,
                          grad_clip=cfg.grad_clip).status == "ok"
    return opt, sched


def snapshot(m: torch.nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # -0.0 != +0.0 here


def test_groups_and_lrs_as_configured():
    m = model()
    cfg = train_cfg(lr_encoder=1e-4, lr_llm=2e-5)  # projector: train.lr
    opt = optimizer_from_config(m, cfg)
    groups = opt.param_groups
    assert [g["module"] for g in groups] == ["projector", "projector", "encoder", "encoder", "llm", "llm"]
    lr = {"projector": 1e-3, "encoder": 1e-4, "llm": 2e-5}
    name = {id(p): n for n, p in m.named_parameters()}
    seen = []
    for g in groups:
        assert g["lr"] == lr[g["module"]]
        decayed = g["weight_decay"] == 0.1
        assert g["weight_decay"] in (0.0, 0.1)
        for p in g["params"]:
            assert (p.ndim >= 2) == decayed  # split by decay / no decay within each module
            assert module_of(name[id(p)]) == g["module"]
            seen.append(name[id(p)])
    assert sorted(seen) == sorted(n for n, p in m.named_parameters() if p.requires_grad)
    assert {"ctc_head.weight", "ctc_head.bias"} <= {n for n in seen if module_of(n) == "projector"}
    assert module_of("module.encoder.blocks.0.ff1.net.0.weight") == "encoder"  # DDP-wrapped names
    assert module_of("_orig_mod.llm.model.embed_tokens.weight") == "llm"
    # the first group (whose lr the step record logs) is the projector's, and the schedule is per group
    sched = scheduler_from_config(opt, cfg, 8)
    assert sched.get_last_lr()[0] == pytest.approx(1e-3 * warmup_cosine(2, 8)(0))
    line = describe_groups(m, opt)
    assert line.startswith("trainable: projector ") and "encoder" in line and "at lr 0.0001" in line
    # posterior projector: the blank embedding is on the projector side
    torch.manual_seed(0)
    post = SpeechLLM(SpeechLLMConfig.from_dict({**tiny_config(ctc_weight=0.3).to_dict(),
                                                 "projector": {"type": "ctc_posterior", "stride": 2}}))
    names = [n for g in optimizer_from_config(post, cfg).param_groups if g["module"] == "projector"
             for n, p in post.named_parameters() if any(p is q for q in g["params"])]
    assert "blank_embedding" in names


def test_lora_adapters_are_the_llm_group():
    pytest.importorskip("peft")
    from west.models.config import LoraSettings

    m = model(lora=LoraSettings(r=2, alpha=4, dropout=0.0))
    opt = optimizer_from_config(m, train_cfg(lr_llm=5e-5))
    llm = [p for g in opt.param_groups if g["module"] == "llm" for p in g["params"]]
    lora = [p for n, p in m.named_parameters() if "lora_" in n]
    assert llm and {id(p) for p in llm} == {id(p) for p in lora}
    assert all(g["lr"] == 5e-5 for g in opt.param_groups if g["module"] == "llm")
    assert "llm (LoRA)" in describe_groups(m, opt)


def test_frozen_blocks_get_no_grad_and_stay_unchanged():
    m = model(freeze_encoder_blocks=1)
    enc = m.encoder
    frozen = [*enc.subsampling.parameters(), *enc.blocks[0].parameters()]
    assert frozen and not any(p.requires_grad for p in frozen)
    assert all(p.requires_grad for p in [*enc.blocks[1].parameters(), *enc.after_norm.parameters()])
    before = snapshot(m)
    grads_seen = []

    def check(step, opt):
        assert all(p.grad is None for p in frozen)
        grads_seen.append(enc.blocks[1].ff1.net[0].weight.grad is not None)

    steps(m, train_cfg(), 3, check)
    assert grads_seen == [True] * 3
    after = snapshot(m)
    for n, p in m.named_parameters():
        same = bitwise_equal(before[n], after[n])
        assert same == (not p.requires_grad), n
    # all blocks frozen is allowed (only the final norm of the encoder trains)
    assert not any(p.requires_grad for p in model(freeze_encoder_blocks=2).encoder.blocks.parameters())


def test_projector_warmup_moves_only_the_projector_side_then_all():
    m = model()
    cfg = train_cfg(projector_warmup_steps=3, lr_encoder=5e-4)
    side = {n for n, _ in m.named_parameters() if module_of(n) == "projector"}
    start = snapshot(m)
    lrs = []
    opt, sched = steps(m, cfg, 3, lambda s, o: lrs.append({g["module"]: g["lr"] for g in o.param_groups}))
    held = snapshot(m)
    for n in start:
        assert bitwise_equal(start[n], held[n]) != (n in side), n   # weight_decay 0.1: still untouched
    assert [x["encoder"] for x in lrs] == [0.0] * 3 and [x["llm"] for x in lrs] == [0.0] * 3
    assert [x["projector"] for x in lrs] == pytest.approx([1e-3 * warmup_cosine(2, 8)(s) for s in range(3)])
    # the held groups' Adam moments do see the warm-up's gradients (documented); only lr is 0
    enc_w = m.encoder.blocks[0].ff1.net[0].weight
    assert opt.state[enc_w]["exp_avg"].abs().sum() > 0
    # after the warm-up every group moves, with its own warmup + cosine over the remaining 5 steps
    assert sched.get_last_lr()[2] == pytest.approx(5e-4 * warmup_cosine(2, 5)(0))
    for s in range(3, 5):
        b = [batches()[s % 4]]
        train_step(m, b, plan_step(b, 1), opt, sched, device=CPU, world_size=1, grad_clip=1.0)
    moved = snapshot(m)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert all(not bitwise_equal(held[n], moved[n]) for n in trainable if n not in side)


def trainer(out, **kw) -> Trainer:
    cfg = train_cfg(projector_warmup_steps=3, max_steps=6, save_every=2, keep_last=5, seed=3, **kw)
    return Trainer(cfg, RunConfig(output_dir=str(out), train_data="x"), model(),
                   ListData(batches()), DistInfo())


def test_resume_mid_warmup_is_bit_exact(tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full_dir.mkdir()
    full = trainer(full_dir, lr_projector=2e-3)
    full.fit()
    (resumed_dir / "checkpoints").mkdir(parents=True)   # step 2 is inside the 3-step warm-up
    shutil.copytree(full_dir / "checkpoints" / "step_00000002", resumed_dir / "checkpoints" / "step_00000002")
    torch.manual_seed(999)
    resumed = trainer(resumed_dir, lr_projector=2e-3)
    resumed.fit()
    assert resumed.step == 6 and resumed.losses == full.losses[2:]
    for (n, a), b in zip(resumed.model.state_dict().items(), full.model.state_dict().values()):
        assert bitwise_equal(a, b) if a.is_floating_point() else torch.equal(a, b), n
    log = [json.loads(x) for x in (full_dir / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["lr"] == pytest.approx(2e-3 * warmup_cosine(2, 6)(0))  # `lr` is the projector's


def test_config_errors_name_their_keys():
    with pytest.raises(ConfigError, match=r"^model\.freeze_encoder_blocks: must be <= model\.encoder\.num_blocks"):
        SpeechLLMConfig.from_dict({**tiny_config().to_dict(), "freeze_encoder_blocks": 3})
    with pytest.raises(ConfigError, match=r"^train\.projector_warmup_steps: must be < train\.max_steps"):
        train_cfg(projector_warmup_steps=8)
    with pytest.raises(ConfigError, match=r"^train\.lr_encoder: must be > 0"):
        train_cfg(lr_encoder=0)
    with pytest.raises(ConfigError, match=r"^train\.lr_encoder: set to 0.0001, but no encoder parameter"):
        optimizer_from_config(model(freeze_encoder=True), train_cfg(lr_encoder=1e-4))
    frozen_llm = SpeechLLM(SpeechLLMConfig.from_dict({**tiny_config().to_dict(), "freeze_llm": True}))
    with pytest.raises(ConfigError, match=r"^train\.lr_llm: "):
        optimizer_from_config(frozen_llm, train_cfg(lr_llm=1e-5))
    no_projector = optimizer_from_config(TokenModel(), train_cfg(max_steps=0, max_epochs=1))
    with pytest.raises(ConfigError, match=r"^train\.projector_warmup_steps: no trainable projector"):
        scheduler_from_config(no_projector, train_cfg(projector_warmup_steps=2), 8)
    with pytest.raises(ConfigError, match=r"^train\.projector_warmup_steps: 4 >= the run's 4 steps"):
        scheduler_from_config(optimizer_from_config(model(), train_cfg()),
                              train_cfg(max_steps=0, max_epochs=1, projector_warmup_steps=4), 4)


def test_resume_with_another_group_layout_fails_clearly():
    from west.checkpoint.training import CheckpointError

    full = scheduler_from_config(optimizer_from_config(model(), train_cfg()), train_cfg(), 8)
    frozen_cfg = SpeechLLMConfig.from_dict({**tiny_config(ctc_weight=0.3).to_dict(), "freeze_llm": True})
    frozen = scheduler_from_config(optimizer_from_config(SpeechLLM(frozen_cfg), train_cfg()), train_cfg(), 8)
    with pytest.raises(CheckpointError, match=r"optimizer groups \(projector, projector, encoder, encoder, llm, llm\)"):
        frozen.load_state_dict(full.state_dict())
    old = {k: v for k, v in full.state_dict().items() if k != "modules"}  # an older west: two groups
    with pytest.raises(CheckpointError, match="differ from this run's"):
        full.load_state_dict({**old, "base_lrs": [1e-3, 1e-3]})
    again = scheduler_from_config(optimizer_from_config(model(), train_cfg(lr_encoder=1e-5)), train_cfg(), 8)
    again.load_state_dict(full.state_dict())  # same layout, other lrs: loads (the saved peaks win)
    assert again.base_lrs == full.base_lrs
