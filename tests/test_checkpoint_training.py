"""Checkpoints: round trip, tied weights, keep-last-K, latest lookup, disk full mid-save, the checks that
find a truncated or unreadable file before a resume."""
from __future__ import annotations

import errno
import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from west.checkpoint import files
from west.checkpoint import training as ck
from west.checkpoint.integrity import check_checkpoint, find_latest
from west.train.schedule import build_optimizer, build_scheduler

from helpers.fakes import TokenModel, make_samples, padded_batch


def trained(seed: int = 0, steps: int = 2):
    model = TokenModel(seed=seed)
    opt = build_optimizer(model, 1e-2, 0.1)
    sched = build_scheduler(opt, 2, 10)
    batch = padded_batch(make_samples(4, seed=seed))
    for _ in range(steps):
        model(batch)["loss_sum"].backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def save(root, step, model, opt, sched, data_state=None, **kw):
    return ck.save_checkpoint(root, step, model=model, optimizer=opt, scheduler=sched,
                              data_state=data_state or {"pos": step}, meta={"epoch": 0}, **kw)


def test_round_trip_restores_everything(tmp_path):
    model, opt, sched = trained()
    torch.manual_seed(5)
    np.random.seed(6)
    random.seed(7)
    path = save(tmp_path, 7, model, opt, sched, data_state={"epoch": 1, "pos": 33})
    expect_rng = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])

    model2, opt2, sched2 = trained(seed=1, steps=1)  # different weights, state, schedule
    torch.manual_seed(0)
    meta = ck.load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)
    assert meta["step"] == 7 and meta["epoch"] == 0 and meta["world_size"] == 1
    assert meta["data_state"] == {"epoch": 1, "pos": 33}
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert sched2.last_epoch == sched.last_epoch and sched2.get_last_lr() == sched.get_last_lr()
    for p, q in zip(opt.param_groups, opt2.param_groups):
        assert p["lr"] == q["lr"]
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg_sq"], s2[i]["exp_avg_sq"]) for i in s1)
    got = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(got[0], expect_rng[0])
    assert np.array_equal(got[1], expect_rng[1]) and got[2] == expect_rng[2]
    # Every non-tensor file loads without unpickling arbitrary objects.
    for f in path.glob("*.pt"):
        torch.load(f, weights_only=True)


def test_non_json_data_state_goes_to_weights_only_file(tmp_path):
    model, opt, sched = trained()
    path = save(tmp_path, 1, model, opt, sched, data_state={"gen": torch.arange(4)})
    assert (path / "data_rank0.pt").is_file() and not (path / "data_rank0.json").exists()
    meta = ck.load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    assert torch.equal(meta["data_state"]["gen"], torch.arange(4))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_tied_weights_saved_once_and_restored(tmp_path):
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    sched = build_scheduler(opt, 0, 0)
    path = save(tmp_path, 1, model, opt, sched)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == 1
    model2 = Tied()
    opt2 = torch.optim.AdamW(model2.parameters())
    ck.load_checkpoint(path, model=model2, optimizer=opt2, scheduler=build_scheduler(opt2, 0, 0))
    assert torch.equal(model2.emb.weight, model.emb.weight)
    assert model2.head.weight is model2.emb.weight


def test_keep_last_and_latest(tmp_path):
    model, opt, sched = trained()
    for step in (10, 20, 30, 40):
        save(tmp_path, step, model, opt, sched, keep_last=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000030", "step_00000040"]
    (tmp_path / ".tmp_step_00000050").mkdir()          # a save killed mid-way
    (tmp_path / "step_00000060").mkdir()               # no meta.json: incomplete
    assert find_latest(tmp_path).name == "step_00000040"
    assert find_latest(tmp_path / "missing") is None
    save(tmp_path, 50, model, opt, sched, keep_last=2)  # cleans the stale temp dir
    assert not (tmp_path / ".tmp_step_00000050").exists()
    assert find_latest(tmp_path).name == "step_00000050"


@pytest.mark.parametrize("target", ["write_bytes", "save_file"])
def test_disk_full_keeps_previous_checkpoint(tmp_path, monkeypatch, target):
    model, opt, sched = trained()
    good = save(tmp_path, 10, model, opt, sched)
    before = {p.name: p.read_bytes() for p in good.iterdir()}

    real = getattr(files, target)

    def full(*args, **kwargs):
        real(*args, **kwargs)  # a partial file lands on disk, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, target, full)
    with pytest.raises(ck.DiskFullError, match="disk full.*step_00000010 kept: free space"):
        save(tmp_path, 20, model, opt, sched)
    monkeypatch.undo()

    assert find_latest(tmp_path) == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010"]
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    meta = ck.load_checkpoint(good, model=model, optimizer=opt, scheduler=sched)
    assert meta["step"] == 10


def test_world_size_mismatch_is_refused(tmp_path):
    model, opt, sched = trained()
    path = save(tmp_path, 3, model, opt, sched)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "world_size": 2}))
    with pytest.raises(ck.CheckpointError, match="saved by 2 ranks"):
        ck.load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)


def test_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "step_00000001").mkdir()
    model, opt, sched = trained()
    with pytest.raises(ck.CheckpointError, match="not a complete checkpoint"):
        ck.load_checkpoint(tmp_path / "step_00000001", model=model, optimizer=opt, scheduler=sched)


def test_check_checkpoint_names_the_damaged_file(tmp_path):
    model, opt, sched = trained()
    good = save(tmp_path, 1, model, opt, sched)
    assert check_checkpoint(good) is None
    cases = {  # file -> damage -> what the check must say
        "model.safetensors": (lambda p: p.write_bytes(p.read_bytes()[:-7]), "model.safetensors: "),
        "optimizer.pt": (lambda p: p.write_bytes(p.read_bytes()[:100]), "optimizer.pt: "),
        "scheduler.pt": (lambda p: p.unlink(), "missing scheduler.pt"),
        "data_rank0.json": (lambda p: p.write_text("{"), "data_rank0.json: "),
        "meta.json": (lambda p: p.write_text('{"step": 2, "world_size": 1}'), "meta.json: step 2 in a dir named"),
    }
    for step, (name, (damage, says)) in enumerate(cases.items(), start=2):
        path = save(tmp_path, step, model, opt, sched, keep_last=10)
        damage(path / name)
        assert check_checkpoint(path).startswith(says), name
    warned: list[str] = []
    assert find_latest(tmp_path, warn=warned.append) == good  # newest first, down to the good one
    assert len(warned) == len(cases) and all("is not usable" in w and f"falling back to {good}" in w for w in warned)
    with pytest.raises(ck.CheckpointError, match="step_00000002: not a complete checkpoint \\(model.safetensors"):
        ck.load_checkpoint(ck.step_dir(tmp_path, 2), model=model, optimizer=opt, scheduler=sched)
