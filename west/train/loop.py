"""The training loop: epochs of equal global steps, per-token loss, checkpoints, logs.

It only relies on the shared contract: batches are :class:`west.batch.Batch`,
``model(batch)`` returns ``dict(loss_sum, n_tokens, n_correct)``, and the data
object follows :class:`west.train.data_interface.TrainData`.

Equal-steps rule: a step runs while ANY rank still has a batch. A rank that is
out of data feeds dummy batches (one tiny sample, all labels IGNORE: zero loss,
zero tokens) so every rank calls forward/backward the same number of times, and
the epoch ends for everyone at the first step where no rank has a real batch.
No rank drops data and none waits on a collective the others never reach. In
pack mode the data side's balanced plan makes the ranks' batch counts equal, so
dummies are not needed there.

Dev evaluation (optional ``evaluator``, west.train.evaluate) runs every
``eval_every`` steps, at each epoch end and at the last step, at most once per
step; with ``keep_best`` a checkpoint follows it, ranked by its dev figures.

Preemption (``train.preempt_signals``, west.train.preempt): a signal on any rank
reaches all of them in the next step's plan; that step runs to its end, then every
rank saves at it (no dev evaluation first) and ``fit`` returns with ``preempted``
set. Agreed at an epoch's end, the checkpoint is taken before the epoch-end work
(summary, evaluation, epoch-end save), which the resumed run then does.
"""
from __future__ import annotations

import math
import random
import time
from contextlib import ExitStack
from pathlib import Path
from typing import ContextManager, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from west.batch import Batch
from west.checkpoint import training as ckpt
from west.checkpoint.base_llm import base_llm_of
from west.checkpoint.integrity import PREFIX, check_checkpoint, latest_usable, set_aside
from west.ranks import all_reduce_max, barrier, disable_cudnn_attention, sum_counts_over_ranks, unwrap
from west.shapes import PackExtent
from west.train.compile import compilations, compile_regions
from west.train.config import RunConfig, TrainConfig
from west.train.data_interface import TrainData
from west.train.distributed import DistInfo, wrap_model
from west.train.encoder_graphs import encoder_shape, static_encoder_for
from west.train.endings import require_trained
from west.train.evaluate import Evaluator
from west.train.gpu_monitor import build_monitor
from west.train.late_readback import PendingStep, check_fused, queue_train_step
from west.train.metrics import (
    AllocatorEvents,
    EpochTotals,
    MetricsLogger,
    peak_memory_mb,
    peak_reserved_mb,
    step_record,
)
from west.train.preempt import Preemption, agreed_signal
from west.train.profiling import build_profiler
from west.train.schedule import optimizer_from_config, scheduler_from_config
from west.train.step import BadStepGuard, StepResult, plan_step, train_step


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def enable_grad_checkpointing(model: nn.Module) -> None:
    fn = getattr(model, "gradient_checkpointing_enable", None)
    if fn is None:
        raise ValueError("train.grad_checkpointing: the model has no gradient_checkpointing_enable()")
    fn()


class StepObserver(Protocol):
    """Something that watches each training step: entered around it, then asked for what the step's
    record in train_log.jsonl should add (the lab's phase marks and host clocks are observers)."""

    def around_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> ContextManager: ...
    def step_record(self) -> dict: ...


class Trainer:
    """Builds the engine around ``model`` and runs :meth:`fit`. ``observers`` watch every step
    (:class:`StepObserver`); a plain west-train run has none."""

    def __init__(self, train: TrainConfig, run: RunConfig, model: nn.Module, data: TrainData,
                 info: DistInfo, evaluator: Optional[Evaluator] = None, pack_tokens: int = 0,
                 observers: Sequence[StepObserver] = ()) -> None:
        self.cfg, self.run, self.info = train, run, info
        self.data, self.evaluator = data, evaluator
        disable_cudnn_attention()
        if train.grad_checkpointing:
            enable_grad_checkpointing(model)
        if train.compile:
            compile_regions(model)
        self.model = wrap_model(model, info, fsdp=train.fsdp, precision=train.precision,
                                find_unused_parameters=train.find_unused_parameters)
        self.encoder_static, self.encoder_shape_note = None, ""
        if train.encoder_graphs == "true":   # sized by the epoch's fullest packs (TrainData.pack_extent)
            extent = getattr(data, "pack_extent", PackExtent)()
            shape, self.encoder_shape_note = encoder_shape(train, pack_tokens, unwrap(model).cfg.projector.stride,
                                                           extent)
            self.encoder_static = static_encoder_for(self.model, shape, train.precision, info.device, info.world_size)
        # The frozen base LLM (model.llm.path) that lean checkpoints refer to instead of storing it.
        self.base = base_llm_of(model)
        self.optimizer = optimizer_from_config(self.model, train)
        if train.late_readback:
            check_fused(self.optimizer)
        self._pending: Optional[tuple] = None   # a step queued, not yet logged (train.late_readback)
        self.scheduler = scheduler_from_config(self.optimizer, train, self._total_steps())
        self.ckpt_root = f"{run.output_dir}/checkpoints"
        self.step = 0
        self.epoch = 0
        self.epoch_complete = False  # the epoch in self.epoch has been fully consumed
        self.guard = BadStepGuard(train.max_bad_steps)
        self.totals = EpochTotals()
        self.last_saved = -1
        self.failed_saves = 0
        self.losses: list[float] = []  # per-step global loss (tests and callers read it)
        self.evaluated: tuple[int, dict] = (-1, {})  # step and figures of the latest dev evaluation
        self.best: Optional[dict] = None  # the best evaluation so far by train.best_metric
        self.preemption = Preemption(train.preempt_signals)  # handlers set while fit() runs
        self.observers = list(observers)
        self.preempted: Optional[str] = None  # the signal, once all ranks agreed to stop

    def _total_steps(self) -> int:
        if self.cfg.max_steps > 0:
            return self.cfg.max_steps
        try:
            n = len(self.data)  # type: ignore[arg-type]
        except TypeError:
            n = -1
        # Every rank must build the same schedule: steps per epoch follow the longest rank.
        n = int(all_reduce_max([n])[0])
        if n < 0:
            return 0  # unknown length: constant lr after warmup
        return math.ceil(n / self.cfg.accum_steps) * self.cfg.max_epochs

    # ------------------------------------------------------------------ resume / save

    def resume_path(self) -> Optional[str]:
        """The checkpoint to resume from (collective with auto/must). A newer step dir that fails
        the checks is reported and set aside (``step_N.corrupt``); an explicit dir must pass them."""
        mode = self.run.resume
        if mode == "never":
            return None
        if mode not in ("auto", "must"):
            problem = check_checkpoint(mode)
            if problem:
                raise ckpt.CheckpointError(f"run.resume {mode}: not a usable checkpoint ({problem})")
            return mode
        latest, bad = latest_usable(self.ckpt_root)
        step = int(latest.name[len(PREFIX):]) if latest else -1
        high, neg_low = all_reduce_max([step, -step])
        if high != -neg_low:  # every rank must load the same one
            raise ckpt.CheckpointError(f"ranks see different newest checkpoints in {self.ckpt_root} (steps "
                                       f"{int(-neg_low)} to {int(high)}): the output dir must be one filesystem "
                                       "all ranks see")
        if self.info.is_main:
            for path, problem in bad:
                moved = set_aside(path)
                print(f"WARNING: checkpoint {path} is not usable ({problem}); moved to {moved.name}; "
                      f"{f'resuming from {latest.name}' if latest else 'no older checkpoint: starting afresh'}",
                      flush=True)
        barrier()
        if latest is None and mode == "must":
            raise ckpt.CheckpointError(f"--resume: no {'usable ' if bad else ''}checkpoint in {self.ckpt_root}")
        return str(latest) if latest else None

    def maybe_resume(self) -> bool:
        path = self.resume_path()
        if path is None:
            return False
        meta = ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                    scheduler=self.scheduler, base=self.base)
        self.step, self.last_saved = int(meta["step"]), int(meta["step"])
        self.epoch, self.epoch_complete = int(meta["epoch"]), bool(meta["epoch_complete"])
        self.guard.load_state_dict(meta["guard"])
        self.totals.load_state_dict(meta["totals"])
        self.data.load_state_dict(meta["data_state"])
        self.evaluated = (self.step, meta["eval"]) if meta.get("eval") else (-1, {})
        self.best = meta.get("best")
        if self.info.is_main:
            how = f"; saved on preemption ({meta['preempted']})" if meta.get("preempted") else ""
            print(f"resumed from {path} (step {self.step}, epoch {self.epoch}{how})", flush=True)
        return True

    def save(self, strict: bool = False) -> None:
        """Collective checkpoint at this step. A failure keeps the previous checkpoint; the run goes
        on with a warning, unless the disk is full (the next saves would fail too) or ``strict``."""
        meta = {"epoch": self.epoch, "epoch_complete": self.epoch_complete,
                "guard": self.guard.state_dict(), "totals": self.totals.state_dict(), "best": self.best}
        if self.evaluated[0] == self.step:
            meta["eval"] = self.evaluated[1]
        if self.preempted:
            meta["preempted"] = self.preempted
        model_cfg = getattr(unwrap(self.model), "cfg", None)
        if hasattr(model_cfg, "to_dict"):   # decode rebuilds this model, whatever config.yaml says later
            meta["model"] = model_cfg.to_dict()
        try:
            ckpt.save_checkpoint(self.ckpt_root, self.step, model=self.model, optimizer=self.optimizer,
                                 scheduler=self.scheduler, data_state=self.data.state_dict(), meta=meta,
                                 keep_last=self.cfg.keep_last, keep_best=self.cfg.keep_best,
                                 best_metric=self.cfg.best_metric,
                                 base=None if self.cfg.save_frozen_llm else self.base)
            self.last_saved = self.step
        except ckpt.CheckpointError as e:  # same outcome on every rank
            if strict or isinstance(e, ckpt.DiskFullError):
                raise
            self.failed_saves += 1
            if self.info.is_main:
                print(f"WARNING: {e}", flush=True)

    def evaluate(self, logger: MetricsLogger) -> dict:
        """Dev evaluation at this step (once per step; collective), logged; {} without a dev list."""
        if self.evaluator is None:
            return {}
        if self.evaluated[0] != self.step:
            figures = self.evaluator.evaluate(self.model)
            self.evaluated = (self.step, figures)
            self.best = ckpt.better_eval(self.best, figures, self.step, self.cfg.best_metric)
            logger.log_eval({"step": self.step, "epoch": self.epoch, "event": "eval", **figures})
        return self.evaluated[1]

    # ------------------------------------------------------------------ steps

    def _fetch(self, it: Iterator[Batch]) -> tuple[list[Batch], int]:
        """Up to accum_steps real batches, topped up with dummies once this rank is out."""
        batches, n_real = [], 0
        for _ in range(self.cfg.accum_steps):
            b = next(it, None) if not self._exhausted else None
            if b is None:
                self._exhausted = True
                b = self.data.dummy_batch()
            else:
                n_real += 1
            batches.append(b)
        return batches, n_real

    def _done(self) -> bool:
        return (self.cfg.max_steps > 0 and self.step >= self.cfg.max_steps) or \
               (self.cfg.max_epochs > 0 and self.epoch >= self.cfg.max_epochs)

    def _run_epoch(self, logger: MetricsLogger, monitor, profiler, allocator: AllocatorEvents) -> bool:
        """Steps until every rank is out of data (True) or max_steps is reached (False)."""
        it, self._exhausted = iter(self.data), False
        while True:
            if self.cfg.max_steps > 0 and self.step >= self.cfg.max_steps:
                self._log_pending(logger)
                return False
            t0 = time.perf_counter()
            batches, n_real = self._fetch(it)
            data_s = time.perf_counter() - t0
            plan = plan_step(batches, n_real, stop=self.preemption.requested is not None)
            if plan.stop and self.preempted is None:
                self._agree_to_stop(plan.stop_ranks)
            if plan.global_real_batches == 0:
                self._log_pending(logger)
                return True  # fit() looks at self.preempted before the epoch-end work
            queue = queue_train_step if self.cfg.late_readback else train_step
            with ExitStack() as watched:
                for observer in self.observers:
                    watched.enter_context(observer.around_step(unwrap(self.model), self.optimizer))
                outcome = queue(self.model, batches, plan, self.optimizer, self.scheduler, device=self.info.device,
                                world_size=self.info.world_size, grad_clip=self.cfg.grad_clip,
                                precision=self.cfg.precision)
            self.step += 1
            wall = time.perf_counter() - t0
            observed = {k: v for observer in self.observers for k, v in observer.step_record().items()}
            reserved = peak_reserved_mb(self.info.device)   # before peak_memory_mb resets the peaks
            host = {"data_wait_s": data_s, **reserved, **monitor.read(), **allocator.read(), **observed}
            self._log_pending(logger)   # the step before (train.late_readback): its figures have arrived
            self._pending = (self.step, self.epoch, outcome, wall, peak_memory_mb(self.info.device), host,
                             [k for b in batches for k in b.keys])
            profiler.step()
            if not self.cfg.late_readback or self.preempted:
                self._log_pending(logger)
            if self.preempted:
                return False  # fit() saves at once: no evaluation in the time left
            evaluate = bool(self.cfg.eval_every) and self.step % self.cfg.eval_every == 0
            if evaluate:
                self._log_pending(logger)
                self.evaluate(logger)
            save = (self.cfg.save_every and self.step % self.cfg.save_every == 0) or self._best_save_due()
            if save:
                self._log_pending(logger)
                self.save()
            if evaluate or save:
                allocator.read()   # what evaluation and saving allocated is not the next step's

    def _log_pending(self, logger: MetricsLogger) -> None:
        """Log the step whose figures are pending (read back now), count it, and let the bad-step
        guard see it (it may raise, on all ranks)."""
        if self._pending is None:
            return
        step, epoch, outcome, wall, peak, host, keys = self._pending
        self._pending = None
        result: StepResult = outcome
        if isinstance(outcome, PendingStep):   # the wait for its figures is its step's time too
            result = outcome.result()
            wall += result.sync_wait_s
        rec = step_record(step, epoch, result, wall, peak, host)
        logger.log_step(rec)
        logger.log_audit(step, epoch, keys)
        self.totals.add(rec, result.loss_sum)
        self.losses.append(result.loss)
        self.guard.update(result.status == "nonfinite", step)

    def _agree_to_stop(self, n_ranks: int) -> None:
        self.preempted = agreed_signal(self.preemption.requested)  # collective: named on every rank
        if self.info.is_main:
            print(f"preemption: {self.preempted} ({n_ranks} of {self.info.world_size} rank(s) signalled): "
                  "stopping at the end of this step with a checkpoint", flush=True)

    def _best_save_due(self) -> bool:
        """keep_best: a dev evaluation at this step without a checkpoint at this step yet."""
        return self.cfg.keep_best > 0 and self.evaluated[0] == self.step and self.last_saved != self.step

    def fit(self) -> dict:
        """Train until max_steps / max_epochs or a preemption signal; returns a short summary.
        The signal handlers (train.preempt_signals) are set only while it runs."""
        with self.preemption:
            return self._fit()

    def _fit(self) -> dict:
        seed_everything(self.cfg.seed + self.info.rank)
        t_start = time.perf_counter()
        resumed = self.maybe_resume()
        self.model.train()
        logger = MetricsLogger(self.run.output_dir, self.info.rank, start_step=self.step,
                               total_steps=self.cfg.max_steps or None,
                               tensorboard=self.cfg.tensorboard, progress_bar=self.cfg.progress_bar,
                               audit=self.run.audit, log_every=self.cfg.log_every)
        monitor = build_monitor(self.info.device.type, self.info.device.index or 0,
                                self.cfg.nvml, self.cfg.monitor_interval_s)
        monitor.start()
        allocator = AllocatorEvents(self.info.device)
        profiler = build_profiler(self.cfg.profile, self.run.output_dir, self.info.device.type,
                                  self.cfg.profile_wait, self.cfg.profile_active, self.info.rank)
        try:
            with profiler:
                if resumed and self.epoch_complete:
                    self.epoch, self.epoch_complete = self.epoch + 1, False
                    self.totals.reset()
                    resumed = False
                while not self._done():
                    if not resumed:
                        self.data.set_epoch(self.epoch)
                    resumed = False
                    if not self._run_epoch(logger, monitor, profiler, allocator) or self.preempted:
                        break  # max_steps inside the epoch, or preempted
                    skipped = getattr(self.data, "skipped_counts", dict)()
                    summary = self.totals.summary(self.epoch, sum_counts_over_ranks(skipped))
                    logger.log_epoch({**summary, **self.evaluate(logger)})
                    require_trained(summary)  # every utterance skipped: an error, not "done"
                    self.epoch_complete = True
                    if self.cfg.save_at_epoch_end or self._best_save_due():
                        self.save()
                    self.epoch, self.epoch_complete = self.epoch + 1, False
                    self.totals.reset()
            if self.preempted and not self._done():
                if self.last_saved != self.step:
                    self._save_preempted()
            else:
                self.preempted = None  # the run ended anyway: a normal finish
                self.evaluate(logger)  # the last step (done already when it ended an epoch)
                if self.last_saved != self.step and self.cfg.save_at_end:
                    self.save()
        finally:
            monitor.stop()
            logger.close()
        best = self.best and {**self.best, "metric": self.cfg.best_metric,
                              "checkpoint": _existing(ckpt.step_dir(self.ckpt_root, self.best["step"]))}
        return {"step": self.step, "epoch": self.epoch, "skipped_steps": self.guard.total,
                "compilations": compilations() if self.cfg.compile else 0,
                "encoder_graph": self.encoder_static.summary() if self.encoder_static is not None else None,
                "failed_saves": self.failed_saves, "partial_epoch_steps": self.totals.steps,
                "wall_s": time.perf_counter() - t_start, "best": best, "checkpoints": self.ckpt_root,
                "preempted": self.preempted, "checkpoint": self._last_checkpoint()}

    def _last_checkpoint(self) -> Optional[str]:
        return _existing(ckpt.step_dir(self.ckpt_root, self.last_saved)) if self.last_saved >= 0 else None

    def _save_preempted(self) -> None:
        try:
            self.save(strict=True)
        except ckpt.CheckpointError as e:
            raise type(e)(f"preempted ({self.preempted}) at step {self.step}: {e}") from e


def _existing(path: Path) -> Optional[str]:
    return str(path) if path.is_dir() else None
