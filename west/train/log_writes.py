"""A failed write of the run's logs ends the run with one clear error, as a failed checkpoint does.

train_log.jsonl, epochs.jsonl, audit/ and tensorboard/ sit next to the checkpoints: when the
disk fills, a log write is as likely to fail first as a checkpoint file. A raw OSError traceback
out of the middle of a step says neither what happened nor what to do; this says the disk is
full (or what else failed), that the previous checkpoint is kept, and that the same command
resumes once there is space.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, TypeVar

from west.checkpoint.training import is_disk_full, list_checkpoints

F = TypeVar("F", bound=Callable[..., Any])


class LogWriteError(RuntimeError):
    """A log of the run could not be written (west-train exits with status 1)."""


def log_write_error(out_dir: Path, what: str, error: BaseException) -> LogWriteError:
    """The message for a failed write of ``what`` under ``out_dir``, naming the checkpoint kept."""
    previous = list_checkpoints(Path(out_dir) / "checkpoints")
    kept = f"previous checkpoint {previous[-1]} kept" if previous else "no checkpoint yet"
    if is_disk_full(error):
        return LogWriteError(f"disk full: cannot write {what} in {out_dir} ({type(error).__name__}: {error}); "
                             f"{kept}: free space, then run the same command to resume")
    return LogWriteError(f"cannot write {what} in {out_dir} ({type(error).__name__}: {error}); {kept}: "
                         "fix the output dir, then run the same command to resume")


def guarded(what: str) -> Callable[[F], F]:
    """Decorate a method of an object with ``.dir`` (the run dir) whose writes of ``what`` may fail:
    an OSError, or any error that carries ENOSPC (TensorBoard's writer thread re-raises its
    own), becomes :class:`LogWriteError`."""
    def wrap(method: F) -> F:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except LogWriteError:
                raise
            except Exception as e:  # noqa: BLE001 - only write failures are converted
                if isinstance(e, OSError) or is_disk_full(e):
                    raise log_write_error(self.dir, what, e) from e
                raise
        return call  # type: ignore[return-value]
    return wrap
