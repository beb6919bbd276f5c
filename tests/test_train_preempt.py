"""Preemption and damaged checkpoints, with the fake model on one process and on two gloo ranks.

A signal (train.preempt_signals) during a step makes every rank finish the next step, save
there and return with ``preempted`` set; resuming gives the uninterrupted run's losses and
weights exactly, also when only one of two ranks was signalled and when the signal comes in
an epoch's last step. The handlers exist only while fit() runs; DataLoader workers, which a
scheduler signals too, survive it. A truncated or unreadable
newest checkpoint is reported, set aside and the previous one used; an explicit --resume of
it is an error. A full disk (OSError ENOSPC, on any rank) stops the run and leaves the
previous checkpoint loadable. The CLI runs (torchrun, exit status) are in test_train_e2e.py.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from west.checkpoint import files
from west.checkpoint import training as ck
from west.checkpoint.integrity import find_latest
from west.train.config import RunConfig, TrainConfig
from west.train.distributed import DistInfo, cleanup
from west.train.loop import Trainer
from west.train.preempt import shield_loader_workers
from west.train.step import TooManyBadSteps

from helpers.fakes import ListData, TokenModel, make_batches
from helpers.ranks import START_METHOD, init_gloo, rank_results, run_ranks

N_BATCHES = 7  # accum 2 -> 4 steps per epoch (steps s = forwards 2s-1, 2s), 2 epochs
RANK_BATCHES = (5, 4)  # two ranks, accum 2 -> 3 steps per epoch


class SignalModel(TokenModel):
    """Sends ``sig`` to its own process during its ``at``-th forward (1-based): mid-step."""

    def __init__(self, at: int = -1, sig: signal.Signals = signal.SIGTERM):
        super().__init__(seed=0, dropout=0.2)
        self.at, self.sig, self.calls = at, sig, 0
        self.handler_seen = None  # SIGTERM's handler during the last forward

    def forward(self, batch):
        self.calls += 1
        self.handler_seen = signal.getsignal(signal.SIGTERM)
        if self.calls == self.at:
            os.kill(os.getpid(), self.sig)
        return super().forward(batch)


def make_trainer(out_dir, at: int = -1, sig=signal.SIGTERM, info: DistInfo = DistInfo(), resume="auto",
                 **train_kw) -> Trainer:
    kw = dict(lr=1e-2, warmup_steps=2, max_epochs=2, accum_steps=2, save_every=3, keep_last=3,
              tensorboard=False, progress_bar=False, log_every=1000, seed=1, nvml=False)
    kw.update(train_kw)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    run = RunConfig(output_dir=str(out_dir), train_data="unused", resume=resume)
    n = N_BATCHES if not info.distributed else RANK_BATCHES[info.rank]
    data = ListData(make_batches(n, seed=10 + info.rank, prefix=f"r{info.rank}_"))
    return Trainer(TrainConfig(**kw), run, SignalModel(at, sig), data, info)


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic in every run of this module
    t = make_trainer(tmp_path_factory.mktemp("full"))
    summary = t.fit()
    assert summary["step"] == 8 and summary["preempted"] is None
    yield t
    torch.set_num_threads(n)


def resume_and_compare(out_dir: Path, full: Trainer, from_step: int, **kw) -> Trainer:
    resumed = make_trainer(out_dir, **kw)  # fresh state: model, RNG and data come from the checkpoint
    torch.manual_seed(12345)
    summary = resumed.fit()
    assert summary["step"] == 8 and summary["preempted"] is None
    assert resumed.losses == full.losses[from_step:]  # exactly
    assert_same_weights(weights(resumed), weights(full))
    return resumed


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_signal_mid_epoch_saves_that_step_then_resume_is_exact(full, tmp_path, name):
    sig = signal.Signals[name]
    before = signal.getsignal(sig)
    t = make_trainer(tmp_path, at=11, sig=sig)  # during step 6: all ranks agree in step 7's plan
    summary = t.fit()
    assert summary["preempted"] == sig.name and (summary["step"], summary["epoch"]) == (7, 1)
    assert summary["checkpoint"] == str(ck.step_dir(tmp_path / "checkpoints", 7))
    assert signal.getsignal(sig) == before  # restored
    assert t.losses == full.losses[:7]
    latest = find_latest(tmp_path / "checkpoints")
    assert latest.name == "step_00000007"  # save_every is 3: this one is the preemption's
    meta = ck.read_meta(latest)
    assert meta["preempted"] == sig.name and meta["epoch_complete"] is False
    resume_and_compare(tmp_path, full, 7)
    log = read_jsonl(tmp_path / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, 9))
    assert [r["loss"] for r in log] == full.losses


def test_signal_in_the_last_step_of_an_epoch_saves_before_the_epoch_end(full, tmp_path):
    t = make_trainer(tmp_path, at=7)  # during step 4, epoch 0's last: the next plan finds no batch
    summary = t.fit()
    assert summary["preempted"] == "SIGTERM" and (summary["step"], summary["epoch"]) == (4, 0)
    meta = ck.read_meta(find_latest(tmp_path / "checkpoints"))
    assert meta["step"] == 4 and meta["epoch_complete"] is False
    assert read_jsonl(tmp_path / "epochs.jsonl") == []  # the epoch-end work is the resumed run's
    resume_and_compare(tmp_path, full, 4)
    epochs = read_jsonl(tmp_path / "epochs.jsonl")
    full_epochs = read_jsonl(Path(full.run.output_dir) / "epochs.jsonl")
    keys = ("epoch", "steps", "utterances", "loss")
    assert [{k: e[k] for k in keys} for e in epochs] == [{k: e[k] for k in keys} for e in full_epochs]


def test_signal_in_the_step_before_the_last_is_a_normal_finish(tmp_path):
    t = make_trainer(tmp_path, at=3, max_steps=3, save_every=0)  # step 3 was the last anyway
    summary = t.fit()
    assert summary["preempted"] is None and summary["step"] == 3
    assert "preempted" not in ck.read_meta(find_latest(tmp_path / "checkpoints"))


def test_handlers_are_set_only_while_fit_runs(tmp_path):
    def mine(signum, frame):
        raise AssertionError("not expected")

    old = signal.signal(signal.SIGTERM, mine)
    try:
        t = make_trainer(tmp_path / "a", max_steps=1)
        t.fit()
        assert t.model.handler_seen == t.preemption._handle and signal.getsignal(signal.SIGTERM) is mine
        off = make_trainer(tmp_path / "b", max_steps=1, preempt_signals=[])
        off.fit()
        assert off.model.handler_seen is mine
        bad = make_trainer(tmp_path / "c", max_bad_steps=1)
        bad.model.poison = True
        with pytest.raises(TooManyBadSteps):
            bad.fit()
        assert signal.getsignal(signal.SIGTERM) is mine  # restored after an error too
    finally:
        signal.signal(signal.SIGTERM, old)


class WorkerPids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        time.sleep(0.02)
        return os.getpid()


@pytest.mark.parametrize("shielded", [True, False])
def test_loader_workers_outlive_a_signal_to_the_whole_job(shielded):
    loader = torch.utils.data.DataLoader(WorkerPids(), batch_size=None, num_workers=1,
                                         multiprocessing_context=START_METHOD)
    if shielded:
        shield_loader_workers(loader, ["SIGTERM", "SIGUSR1"])
    it = iter(loader)
    worker = next(it)
    os.kill(worker, signal.SIGTERM)  # as a scheduler does to every process of the job
    if shielded:
        time.sleep(0.3)
        assert list(it) == [worker] * 5
        return
    deadline = time.time() + 5  # torch's workers die of it (the loader would fail within 5 s)
    while _state(worker) not in ("Z", "gone") and time.time() < deadline:
        time.sleep(0.02)
    assert _state(worker) in ("Z", "gone")
    del it


def _state(pid: int) -> str:
    """A process's state letter from /proc (Z: a zombie, exited, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def refused_then_fallen_back(tmp_path, full, bad, problem: str, capsys) -> str:
    """``--resume BAD`` is an error naming ``problem``; a plain resume sets step 8's checkpoint aside,
    resumes from step 6 and trains as the uninterrupted run did. Returns what it printed."""
    with pytest.raises(ck.CheckpointError, match=f"run.resume {bad}: not a usable checkpoint \\({problem}"):
        make_trainer(tmp_path, resume=str(bad)).fit()  # an explicit dir must be whole
    capsys.readouterr()
    resume_and_compare(tmp_path, full, 6, save_every=2)
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint {bad} is not usable ({problem}" in out
    assert "moved to step_00000008.corrupt; resuming from step_00000006" in out
    return out


CORRUPTIONS = {  # what a lost write or a copy cut short leaves in the newest checkpoint
    "truncated model": (lambda d: _truncate(d / "model.safetensors"), "model.safetensors: "),
    "bad meta.json": (lambda d: (d / "meta.json").write_text('{"step": 8, "epo'), "meta.json: "),
    "truncated optimizer": (lambda d: _truncate(d / "optimizer.pt"), "optimizer.pt: "),
    "missing rng state": (lambda d: (d / "rng_rank0.pt").unlink(), "missing rng_rank0.pt"),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_newest_checkpoint_falls_back_with_a_message(full, tmp_path, capsys, kind):
    make_trainer(tmp_path, save_every=2).fit()  # checkpoints at steps 4, 6, 8 (keep_last 3)
    root = tmp_path / "checkpoints"
    bad = ck.step_dir(root, 8)
    damage, problem = CORRUPTIONS[kind]
    damage(bad)
    out = refused_then_fallen_back(tmp_path, full, bad, problem, capsys)
    assert "(step 6, epoch 1)" in out
    assert (root / "step_00000008.corrupt").is_dir()  # kept for inspection, no longer a checkpoint
    assert [p.name for p in ck.list_checkpoints(root)] == ["step_00000004", "step_00000006", "step_00000008"]


@pytest.mark.parametrize("at, failing, kept, err", [(-1, 6, 4, errno.ENOSPC), (11, 7, 6, errno.ENOSPC),
                                                     (-1, 6, 4, errno.EIO)],
                         ids=["disk full in a periodic save", "disk full in the preemption save",
                              "another error: warned, the run goes on"])
def test_disk_full_stops_the_run_and_keeps_the_previous_checkpoint(full, tmp_path, monkeypatch, at, failing, kept,
                                                                    err):
    real = files.write_bytes

    def failing_write(path, data):
        real(path, data)  # a partial file lands on disk, then the write fails
        if f"step_{failing:08d}" in str(path):
            raise OSError(err, os.strerror(err))

    monkeypatch.setattr(files, "write_bytes", failing_write)
    t = make_trainer(tmp_path, at=at)  # saves at 3, 4 (epoch end), 6...; a signal in step 6 stops after 7
    if err != errno.ENOSPC:
        assert t.fit()["failed_saves"] == 1
        return
    where = "preempted \\(SIGTERM\\) at step 7: " if at > 0 else ""
    with pytest.raises(ck.DiskFullError, match=f"^{where}checkpoint at step {failing} failed \\(disk full\\).*"
                                               f"step_{kept:08d} kept: free space, then run the same command"):
        t.fit()
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        [f"step_{s:08d}" for s in (3, 4, 6) if s <= kept]  # no partial dir left
    resume_and_compare(tmp_path, full, kept)


# ----------------------------------------------------------------------------- two ranks

def _fit(out: str, info: DistInfo, **kw) -> dict:
    t = make_trainer(out, info=info, **kw)
    try:
        summary = t.fit()
    except ck.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}
    sd = t.model.module.state_dict()
    return {**summary, "losses": t.losses, "weights": {k: v.detach().clone() for k, v in sd.items()}}


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    info = init_gloo(rank, world, port)
    res = {"full": _fit(f"{tmp}/full", info)}
    for signalled in (0, 1):  # only one rank gets SIGTERM, during step 4 (epoch 1's first)
        out = f"{tmp}/only{signalled}"
        res[f"only{signalled}"] = _fit(out, info, at=7 if rank == signalled else -1)
        res[f"only{signalled}_resumed"] = _fit(out, info)
    # A full disk on rank 1 only, in the save at step 6: every rank stops with the same error.
    real = files.write_bytes

    def full_disk(path, data):
        if rank == 1 and "step_00000006" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    files.write_bytes = full_disk
    res["disk_full"] = _fit(f"{tmp}/disk", info)
    files.write_bytes = real
    res["disk_full_resumed"] = _fit(f"{tmp}/disk", info)
    torch.save(res, f"{tmp}/rank{rank}.pt")
    cleanup()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preempt2")
    run_ranks(_worker, str(tmp))
    return tmp, rank_results(tmp)


@pytest.mark.parametrize("signalled", [0, 1])
def test_two_ranks_one_signalled_both_save_then_resume_is_exact(two_ranks, signalled):
    tmp, rs = two_ranks
    for rank, r in enumerate(rs):
        full, stopped, resumed = r["full"], r[f"only{signalled}"], r[f"only{signalled}_resumed"]
        assert full["step"] == 6
        assert stopped["preempted"] == "SIGTERM"  # named on every rank, whichever got it
        assert stopped["step"] == 5 and stopped["losses"] == full["losses"][:5]
        assert resumed["preempted"] is None and resumed["losses"] == full["losses"][5:]
        assert_same_weights(resumed["weights"], full["weights"])
    meta = ck.read_meta(tmp / f"only{signalled}" / "checkpoints" / "step_00000005")
    assert meta["world_size"] == 2 and meta["preempted"] == "SIGTERM"  # rank 0 writes it, rank 1 may have got it
    assert (tmp / f"only{signalled}" / "checkpoints" / "step_00000005" / "data_rank1.json").is_file()


def test_two_ranks_disk_full_on_one_stops_both(two_ranks):
    tmp, rs = two_ranks
    for r in rs:
        assert r["disk_full"]["error"] == "DiskFullError"
        assert "checkpoint at step 6 failed (disk full)" in r["disk_full"]["message"]
        assert r["disk_full_resumed"]["losses"] == r["full"]["losses"][3:]
        assert_same_weights(r["disk_full_resumed"]["weights"], r["full"]["weights"])
    assert "No space left on device" in rs[1]["disk_full"]["message"]  # the rank that had it says what
