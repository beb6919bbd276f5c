"""Per-token loss over the whole step on one process: same parameters after one step
whatever the layout (static / dynamic / pack) or accumulation (1 / 4); NaN/inf steps
skipped. The 2-rank (DDP / FSDP2) half of the check is in test_train_ddp.py."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from west.train.step import BadStepGuard, StepPlan, TooManyBadSteps, plan_step, train_step

from test_train_fakes import TokenModel, dummy_batch, make_samples, packed_batch, padded_batch

SAMPLES = make_samples(24, seed=3)
LR = 0.5
# Uneven cuts so that micro-batches and ranks hold very different token counts.
RANK_CUT = 7
MICRO_CUTS = {1: [0.0, 1.0], 4: [0.0, 0.1, 0.45, 0.6, 1.0]}


def reference_params() -> dict[str, torch.Tensor]:
    """One SGD step on (Σ token CE over all samples) / (Σ label tokens), computed directly."""
    model = TokenModel()
    out = model(padded_batch(SAMPLES))
    (out["loss_sum"] / out["n_tokens"]).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def micro_batches(samples, accum: int, layout: str):
    if layout == "dynamic":  # boundaries by a token budget instead of fixed fractions
        groups, cur, budget = [], [], max(1, sum(len(s[1]) for s in samples) // accum + 1)
        for s in samples:
            if cur and sum(len(c[1]) for c in cur) + len(s[1]) > budget and len(groups) < accum - 1:
                groups.append(cur)
                cur = []
            cur.append(s)
        groups.append(cur)
    else:
        cuts = [round(f * len(samples)) for f in MICRO_CUTS[accum]]
        groups = [samples[a:b] for a, b in zip(cuts, cuts[1:])]
    out = []
    for g in groups:
        if not g:
            out.append(dummy_batch())
        elif layout == "pack":
            out.append(packed_batch(g, sum(len(s[1]) for s in g) + 3))
        else:
            out.append(padded_batch(g))
    while len(out) < accum:
        out.append(dummy_batch())
    return out


def one_step(model, batches, world: int) -> dict[str, object]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    plan = plan_step(batches, sum(1 for b in batches if b.keys))
    res = train_step(model, batches, plan, opt, sched, device=torch.device("cpu"), world_size=world)
    return {"status": res.status, "loss": res.loss, "n_tokens": res.n_tokens,
            "utterances": res.counters["utterances"]}


def _assert_close(params: dict, ref: dict, what: str) -> None:
    for k, v in ref.items():
        torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("layout", ["static", "dynamic", "pack"])
def test_one_rank_matches_reference(accum, layout):
    model = TokenModel()
    batches = micro_batches(SAMPLES, accum, layout)
    stats = one_step(model, batches, world=1)
    assert stats["status"] == "ok"
    assert stats["utterances"] == len(SAMPLES)
    _assert_close(model.state_dict(), reference_params(), f"w1-a{accum}-{layout}")


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
    _assert_close(model.state_dict(), before, "nan")


def test_empty_step_when_no_label_tokens():
    model = TokenModel()
    before = copy.deepcopy(model.state_dict())
    stats = one_step(model, [dummy_batch(), dummy_batch()], world=1)
    assert stats["status"] == "empty"
    _assert_close(model.state_dict(), before, "empty")


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
