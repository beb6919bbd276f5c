"""Per-token loss over the whole step on one process: same parameters after one step
whatever the layout (static / dynamic / pack) or accumulation (1 / 4); NaN/inf steps
skipped. The 2-rank (DDP / FSDP2) half of the check is in test_train_ddp.py."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from west.train.step import BadStepGuard, StepPlan, TooManyBadSteps

from helpers.fakes import TokenModel, dummy_batch, padded_batch
from helpers.steps import SAMPLES, assert_close, micro_batches, one_step, reference_params


@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("layout", ["static", "dynamic", "pack"])
def test_one_rank_matches_reference(accum, layout):
    model = TokenModel()
    batches = micro_batches(SAMPLES, accum, layout)
    stats = one_step(model, batches, world=1)
    assert stats["status"] == "ok"
    assert stats["utterances"] == len(SAMPLES)
    assert_close(model.state_dict(), reference_params(), f"w1-a{accum}-{layout}")


def test_loss_is_global_per_token_mean():
    model = TokenModel()
    with torch.no_grad():
        out = model(padded_batch(SAMPLES))
    expected = float(out["loss_sum"]) / out["n_tokens"]
    stats = one_step(TokenModel(), micro_batches(SAMPLES, 4, "pack"), world=1)
    assert stats["loss"] == pytest.approx(expected, rel=1e-6)


def test_nan_skip_zeroes_grads_and_keeps_params():
    model = TokenModel()
    model.poison = True
    before = copy.deepcopy(model.state_dict())
    stats = one_step(model, micro_batches(SAMPLES, 4, "static"), world=1)
    assert stats["status"] == "nonfinite"
    assert all(p.grad is None for p in model.parameters())
    assert_close(model.state_dict(), before, "nan")


def test_empty_step_when_no_label_tokens():
    model = TokenModel()
    before = copy.deepcopy(model.state_dict())
    stats = one_step(model, [dummy_batch(), dummy_batch()], world=1)
    assert stats["status"] == "empty"
    assert_close(model.state_dict(), before, "empty")


def test_double_shift_is_caught():
    class Shifting(TokenModel):
        def forward(self, batch):
            out = super().forward(batch)
            out["n_tokens"] -= 1
            return out

    with pytest.raises(RuntimeError, match="already shifted"):
        one_step(Shifting(), micro_batches(SAMPLES, 1, "static"), world=1)


def test_bad_step_guard_counts_in_a_row():
    g = BadStepGuard(3)
    for step, bad in enumerate([True, True, False, True, True], 1):
        g.update(bad, step)
    assert (g.in_row, g.total) == (2, 4)
    with pytest.raises(TooManyBadSteps, match="max_bad_steps=3"):
        g.update(True, 6)


def test_loss_scale():
    plan = StepPlan(local_tokens=10, global_tokens=40, global_real_batches=3)
    assert plan.loss_scale(world_size=2) == pytest.approx(2 / 40)
    assert math.isfinite(StepPlan(0, 0, 1).loss_scale(4))


def test_host_split_attributes_the_step_to_its_phases():
    """launch_s covers forward/backward (a slow forward shows there), update_s the optimizer
    (a slow update shows there, not in launch_s): the split a host-bound GPU step is read by."""
    import time

    from west.train.step import plan_step, train_step

    class SlowForward(TokenModel):
        def forward(self, batch):
            time.sleep(0.02)
            return super().forward(batch)

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.5)   # far above what queueing the tiny step takes on a loaded 2-core machine
            return super().step(closure)

    model = SlowForward()
    batches = micro_batches(SAMPLES, 1, "pack")
    opt = SlowSGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    res = train_step(model, batches, plan_step(batches, 1), opt, sched, device=torch.device("cpu"), world_size=1)
    assert res.status == "ok"
    assert 0.02 <= res.launch_s < 0.5 <= res.update_s
    assert 0.0 <= res.sync_wait_s < 0.5


def test_grad_norm_is_the_trainable_gradients_norm_before_clipping():
    """The step clips the optimizer's parameters by their global norm and reports the norm before
    clipping; a frozen parameter (no gradient, not in the optimizer) takes no part."""
    from west.train.step import plan_step, train_step

    batches = micro_batches(SAMPLES, 4, "pack")
    ref = TokenModel()
    ref.norm.weight.requires_grad_(False)
    scale = 1.0 / sum(int((b.labels != -100).sum()) for b in batches)
    for b in batches:
        (ref(b)["loss_sum"] * scale).backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    want = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))

    model = TokenModel()
    model.norm.weight.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    clip = want / 4
    res = train_step(model, batches, plan_step(batches, len(batches)), opt, sched, device=torch.device("cpu"),
                     world_size=1, grad_clip=clip)
    assert res.grad_norm == pytest.approx(want, rel=1e-5)
    for n, p in model.named_parameters():
        if n in grads:   # SGD with lr 1: the step is the clipped gradient
            torch.testing.assert_close(before[n] - p.detach(), grads[n] * (clip / want), rtol=1e-4, atol=1e-6)
        else:
            assert torch.equal(p.detach(), before[n])
