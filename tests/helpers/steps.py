"""The reference SGD step and the sample split the step and DDP tests compare against."""
from __future__ import annotations

import torch

from west.train.step import plan_step, train_step

from helpers.fakes import TokenModel, dummy_batch, make_samples, packed_batch, padded_batch

SAMPLES = make_samples(24, seed=3)


# Uneven cuts so that micro-batches and ranks hold very different token counts.
RANK_CUT = 7


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


def assert_close(params: dict, ref: dict, what: str) -> None:
    for k, v in ref.items():
        torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


LR = 0.5


MICRO_CUTS = {1: [0.0, 1.0], 4: [0.0, 0.1, 0.45, 0.6, 1.0]}
