"""AdamW parameter groups and the warmup + cosine schedule."""
from __future__ import annotations

import math

import pytest
from torch import nn

from west.train.schedule import build_optimizer, build_scheduler, param_groups, warmup_cosine


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_no_decay_on_biases_and_norms_frozen_left_out():
    net = Net()
    decay, keep = param_groups(net, 0.1)
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(net.emb.weight), id(net.proj.weight)}
    assert {id(p) for p in keep["params"]} == {id(net.proj.bias), id(net.norm.weight), id(net.norm.bias)}
    opt = build_optimizer(net, 1e-3, 0.1, betas=[0.9, 0.95])
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer(net.frozen, 1e-3, 0.1)


def test_warmup_then_cosine_to_floor():
    f = warmup_cosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 20))
    const = warmup_cosine(2, 0)  # unknown run length: constant after warmup
    assert [const(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert warmup_cosine(0, 10)(0) == 1.0


def test_scheduler_state_round_trips_and_follows_new_length():
    net = Net()
    opt = build_optimizer(net, 1.0, 0.0)
    sched = build_scheduler(opt, 2, 10)
    for _ in range(5):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = build_optimizer(Net(), 1.0, 0.0)
    sched2 = build_scheduler(opt2, 2, 20)  # resumed with a longer run
    sched2.load_state_dict(state)
    assert sched2.last_epoch == 5
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(warmup_cosine(2, 20)(6))
