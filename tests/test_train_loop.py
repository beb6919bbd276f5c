"""The loop on one CPU process: epochs/steps, logs, audit, and kill -9 + resume giving the
exact loss sequence of an uninterrupted run."""
from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch

from west.batch import COUNTER_NAMES
from west.checkpoint.integrity import find_latest
from west.train.config import RunConfig, TrainConfig
from west.train.distributed import DistInfo
from west.train.loop import Trainer

from helpers.fakes import ListData, TokenModel, make_batches
from helpers.ranks import run_child

N_BATCHES = 7  # accum 2 -> 4 steps per epoch, the last one half dummy


def make_trainer(out_dir, kill_at: int = -1, resume: str = "auto", **train_kw) -> Trainer:
    kw = dict(lr=1e-2, warmup_steps=2, max_epochs=2, accum_steps=2, save_every=2, keep_last=2,
              tensorboard=False, progress_bar=False, log_every=1000, seed=1, nvml=False)
    kw.update(train_kw)
    run = RunConfig(output_dir=str(out_dir), train_data="unused", resume=resume, audit=True)
    model = TokenModel(seed=0, dropout=0.2)
    return Trainer(TrainConfig(**kw), run, model, ListData(make_batches(N_BATCHES), kill_at), DistInfo())


def fit_killed(out_dir: Path, kill_at: int) -> None:
    """The killed child's run (module-level: a spawned child imports it), one thread as here."""
    torch.set_num_threads(1)
    make_trainer(out_dir, kill_at=kill_at).fit()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, one_torch_thread):
    out = tmp_path_factory.mktemp("full")
    t = make_trainer(out)
    summary = t.fit()
    return out, t, summary


def test_epochs_steps_and_logs(uninterrupted):
    out, t, summary = uninterrupted
    assert {k: summary[k] for k in ("step", "epoch", "skipped_steps", "failed_saves", "best")} == \
        {"step": 8, "epoch": 2, "skipped_steps": 0, "failed_saves": 0, "best": None}
    log = read_jsonl(out / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, 9))
    assert [r["epoch"] for r in log] == [0] * 4 + [1] * 4
    need = {"loss", "lr", "grad_norm", "step_time_s", "utts_per_s", "tokens_per_s", "peak_mem_mb",
            "cpu_util_pct", *COUNTER_NAMES}
    assert need <= set(log[0])
    assert [r["loss"] for r in log] == pytest.approx(t.losses, rel=1e-12)
    assert log[0]["lr"] == pytest.approx(1e-2 / 2)  # warmup step 1 of 2
    assert sum(r["utterances"] for r in log) == 2 * N_BATCHES * 3
    epochs = read_jsonl(out / "epochs.jsonl")
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert epochs[0]["steps"] == 4 and epochs[0]["utterances"] == N_BATCHES * 3
    assert epochs[0]["skipped_inputs"] == {"too_long": 1}
    assert math.isfinite(epochs[1]["loss"])
    audit = read_jsonl(out / "audit" / "rank0.jsonl")
    keys0 = [k for r in audit if r["epoch"] == 0 for k in r["keys"]]
    assert len(keys0) == len(set(keys0)) == N_BATCHES * 3
    assert find_latest(out / "checkpoints").name == "step_00000008"


def test_max_steps_stops_mid_epoch_and_saves(tmp_path, one_torch_thread):
    t = make_trainer(tmp_path, max_steps=3, save_every=0)
    assert t.fit()["step"] == 3
    assert find_latest(tmp_path / "checkpoints").name == "step_00000003"
    # A resumed run with a higher limit continues from step 3, not from scratch.
    t2 = make_trainer(tmp_path, max_steps=5, save_every=0)
    assert t2.fit()["step"] == 5
    assert [r["step"] for r in read_jsonl(tmp_path / "train_log.jsonl")] == [1, 2, 3, 4, 5]


def test_save_at_end_false_writes_no_checkpoint_for_a_run_that_ends_mid_epoch(tmp_path, one_torch_thread):
    """A throughput run (tools/gpu_suite.sh): no periodic, epoch-end or final save, so nothing is written."""
    t = make_trainer(tmp_path, max_steps=3, save_every=0, save_at_epoch_end=False, save_at_end=False)
    summary = t.fit()
    assert summary["step"] == 3 and summary["checkpoint"] is None
    assert find_latest(tmp_path / "checkpoints") is None
    # an epoch's end still saves when asked to: save_at_end covers only the run's last step
    t2 = make_trainer(tmp_path / "epochs", max_steps=6, save_every=0, save_at_end=False)
    assert t2.fit()["checkpoint"].endswith("step_00000004")


def test_kill_9_then_resume_matches_uninterrupted(uninterrupted, tmp_path):
    full_dir, full, _ = uninterrupted
    # Killed (SIGKILL, no cleanup) while fetching step 8: steps 1..7 are logged, the
    # latest checkpoint is step 6.
    assert run_child(fit_killed, tmp_path, N_BATCHES + 6) == -signal.SIGKILL
    assert find_latest(tmp_path / "checkpoints").name == "step_00000006"
    assert len(read_jsonl(tmp_path / "train_log.jsonl")) == 7

    resumed = make_trainer(tmp_path)  # fresh process state: model/RNG/data come from the checkpoint
    torch.manual_seed(12345)
    resumed.fit()
    assert resumed.losses == full.losses[6:]  # exact, not approximately
    log = read_jsonl(tmp_path / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, 9))
    assert [r["loss"] for r in log] == [r["loss"] for r in read_jsonl(full_dir / "train_log.jsonl")]
    audit = read_jsonl(tmp_path / "audit" / "rank0.jsonl")
    for epoch in (0, 1):
        keys = [k for r in audit if r["epoch"] == epoch for k in r["keys"]]
        assert len(keys) == len(set(keys)) == N_BATCHES * 3  # exactly once per epoch
    for a, b in zip(resumed.model.state_dict().values(), full.model.state_dict().values()):
        assert torch.equal(a, b)


def test_resume_must_without_checkpoint_fails(tmp_path):
    from west.checkpoint.training import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint"):
        make_trainer(tmp_path, resume="must").fit()


def test_nan_steps_stop_after_max_bad_steps(tmp_path):
    t = make_trainer(tmp_path, max_bad_steps=2)
    t.model.poison = True
    from west.train.step import TooManyBadSteps

    with pytest.raises(TooManyBadSteps):
        t.fit()
    log = read_jsonl(tmp_path / "train_log.jsonl")
    assert [r["status"] for r in log] == ["nonfinite", "nonfinite"]
    assert log[0]["loss"] is None  # NaN is written as null


def test_grad_checkpointing_needs_model_support(tmp_path):
    with pytest.raises(ValueError, match="grad_checkpointing"):
        make_trainer(tmp_path, grad_checkpointing=True)
