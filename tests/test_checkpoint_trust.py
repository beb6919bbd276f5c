"""Checkpoints that can be trusted: damaged bytes are found before a resume, a bad state never
becomes a checkpoint (nor prunes the last good one), and any writer's failure (safetensors'
``SafetensorError`` included) keeps the previous checkpoint with the disk-full message.

Uses the fake model runs of test_train_preempt (8 steps, 2 epochs, accum 2, one process)."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from west.checkpoint import checksums, files
from west.checkpoint import training as ck
from west.checkpoint.integrity import check_checkpoint, find_latest
from west.train.log_writes import LogWriteError
from west.train.step import TooManyBadSteps

import test_train_preempt as preempt
from helpers.fakes import TokenModel
from test_train_preempt import make_trainer, refused_then_fallen_back, resume_and_compare


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted 8-step run that resumed runs are compared with."""
    yield from preempt.full.__wrapped__(tmp_path_factory)


def _flip(path: Path) -> None:
    """Change one byte in the middle of ``path``; in a JSON file one digit of a number (the file
    still parses: only its checksum can tell)."""
    data = bytearray(path.read_bytes())
    if path.suffix == ".json":
        digits = [i for i, c in enumerate(data) if chr(c).isdigit()]
        i = digits[len(digits) // 2]
        data[i] = ord(str((int(chr(data[i])) + 1) % 10))
    else:
        i = len(data) * 3 // 4  # inside the tensor bytes of the safetensors / torch zip files
        data[i] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_rank0.pt",
                                  "data_rank0.json", "meta.json"])
def test_a_flipped_byte_in_any_file_is_found_and_the_previous_checkpoint_used(full, tmp_path, capsys, name):
    make_trainer(tmp_path, save_every=2).fit()  # checkpoints at steps 4, 6, 8
    root = tmp_path / "checkpoints"
    bad = ck.step_dir(root, 8)
    assert check_checkpoint(bad) is None
    _flip(bad / name)
    assert check_checkpoint(bad).startswith(f"{name}: checksum mismatch")
    refused_then_fallen_back(tmp_path, full, bad, f"{name}: checksum mismatch", capsys)


def test_checksums_cover_every_file_with_one_mode(tmp_path):
    make_trainer(tmp_path, max_steps=2, save_every=2).fit()
    step = ck.step_dir(tmp_path / "checkpoints", 2)
    table = (step / checksums.CHECKSUMS).read_text()
    names = sorted(p.name for p in step.iterdir() if p.name != checksums.CHECKSUMS)
    assert all(f'"{n}"' in table for n in names) and "model.safetensors" in names
    modes = {stat.S_IMODE(p.stat().st_mode) for p in step.iterdir()}
    assert modes == {files.file_mode()}  # safetensors alone would write model.safetensors 0600
    (step / "extra.txt").write_text("x")
    assert check_checkpoint(step) == f"extra.txt: not listed in {checksums.CHECKSUMS} (added or renamed after the save)"


class NaNAt(TokenModel):
    """Its weights turn NaN during forward ``at`` (as a damaged optimizer state makes them)."""

    def __init__(self, at: int):
        super().__init__(seed=0, dropout=0.2)
        self.at, self.calls = at, 0

    def forward(self, batch):
        self.calls += 1
        if self.calls == self.at:
            with torch.no_grad():
                self.out.weight.fill_(float("nan"))
        return super().forward(batch)


def test_nan_steps_never_replace_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preempt, "SignalModel", lambda at, sig: NaNAt(at=7))
    t = make_trainer(tmp_path, save_every=1, keep_last=1, max_bad_steps=3)  # NaN in step 4 (forward 7)
    with pytest.raises(TooManyBadSteps):
        t.fit()
    root = tmp_path / "checkpoints"
    assert [p.name for p in ck.list_checkpoints(root)] == ["step_00000003"]
    assert "no checkpoint at step 4: the last 1 step(s) were non-finite" in capsys.readouterr().out
    state = files.load_tensors(find_latest(root) / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in state.values())


def test_a_nan_weight_is_never_saved_even_without_a_bad_step(tmp_path):
    t = make_trainer(tmp_path, max_steps=2, save_every=1, keep_last=1)
    t.fit()
    with torch.no_grad():
        t.model.norm.bias[0] = float("inf")
    with pytest.raises(ck.NotFiniteError, match="norm.bias holds NaN/inf; previous checkpoint .*step_00000002 kept"):
        t.save(strict=True)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000002"]  # no temp dir left


def _safetensors_full(tensors, path, *args, **kwargs):
    Path(path).write_bytes(b"partial")
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_in_the_safetensors_writer_keeps_the_previous_checkpoint(full, tmp_path, monkeypatch):
    """safetensors raises SafetensorError, not OSError (the other writers' ENOSPC: test_train_preempt)."""
    t = make_trainer(tmp_path)  # saves at 3, 4 (epoch end), 6: the one at 6 fails
    real = files.save_file

    def failing(tensors, path, *a, **kw):
        return (_safetensors_full if "step_00000006" in str(path) else real)(tensors, path, *a, **kw)

    monkeypatch.setattr(files, "save_file", failing)
    with pytest.raises(ck.DiskFullError, match="checkpoint at step 6 failed \\(disk full\\).*step_00000004 kept: "
                                               "free space, then run the same command"):
        t.fit()
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    resume_and_compare(tmp_path, full, 4)


class FullDiskFile:
    """An open file whose writes fail with ENOSPC (as a log file's do when the disk fills)."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("target, kept", [("train_log.jsonl", 3), ("epochs.jsonl", 3), ("rank0.jsonl", 3),
                                          ("tensorboard", 3)])
def test_a_full_disk_in_any_log_writer_is_one_clear_error(tmp_path, monkeypatch, target, kept):
    """Each log fails from step 4 on (train_log, audit, TensorBoard: its step line; epochs.jsonl: the
    epoch's end at step 4); the checkpoint at step 3 is kept and named."""
    from west.train import metrics

    state = {"armed": False}
    real_open = open

    def opening(path, *a, **kw):
        f = real_open(path, *a, **kw)
        return FullDiskFile(f) if Path(path).name == target and state["armed"] else f

    monkeypatch.setattr(metrics, "open", opening, raising=False)
    real_log_step = metrics.MetricsLogger.log_step

    def log_step(self, rec):
        if rec["step"] == 4 and not state["armed"]:
            state["armed"] = True
            if target == "train_log.jsonl":
                self._log = FullDiskFile(self._log)
            if target == "rank0.jsonl":
                self._audit = FullDiskFile(self._audit)
        return real_log_step(self, rec)

    monkeypatch.setattr(metrics.MetricsLogger, "log_step", log_step)
    if target == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        def add_scalar(self, *a, **kw):
            if state["armed"]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    t = make_trainer(tmp_path, tensorboard=target == "tensorboard")
    t.run.audit = True
    with pytest.raises(LogWriteError, match=f"^disk full: cannot write .*No space left on device.*step_{kept:08d} "
                                            "kept: free space, then run the same command to resume"):
        t.fit()
