"""Timed training passes through the production step, each from the same initial weights."""
from __future__ import annotations

import gc
import resource
import statistics
import time
from typing import Iterator, Optional, Sequence

import torch

from west.batch import Batch
from west.ranks import disable_cudnn_attention
from west.train.config import TrainConfig
from west.train.gpu_monitor import build_monitor
from west.train.late_readback import check_fused, queue_train_step
from west.train.metrics import AllocatorEvents, peak_reserved_mb
from west.train.schedule import build_optimizer, build_scheduler
from west.train.step import StepResult, plan_step, train_step

# StepResult's host seconds, summed over a pass: queueing forward/backward/clip, blocked in the
# step's read-back, queueing the update
HOST_SPLIT = ("launch_s", "sync_wait_s", "update_s")


class PassRunner:
    """Timed training passes from one fixed initial state. The initial weights are kept in host
    memory: a copy on the GPU would take part of a memory budget that training does not spend."""

    def __init__(self, model: torch.nn.Module, train: TrainConfig, device: torch.device, seed: int):
        self.model, self.train, self.device, self.seed = model, train, device, seed
        disable_cudnn_attention()   # as west-train sets it
        self.init = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def fresh(self, n_steps: int):
        """The initial weights back, train mode, the seed, a new AdamW and schedule: (optimizer, scheduler)."""
        self.model.load_state_dict(self.init)
        self.model.zero_grad(set_to_none=True)   # no gradient left by work between passes
        self.model.train()
        torch.manual_seed(self.seed)
        t = self.train
        opt = build_optimizer(self.model, t.lr, t.weight_decay, t.betas, t.eps)
        if t.late_readback:
            check_fused(opt)
        return opt, build_scheduler(opt, t.warmup_steps, n_steps, t.min_lr_ratio)

    def step(self, b: Batch, opt, sched, queue=train_step):
        """One step, its figures read back before the update (the profilers' and counters' unit);
        ``queue=queue_train_step``: queued, its figures on their way (a PendingStep)."""
        return queue(self.model, [b], plan_step([b], 1), opt, sched, device=self.device, world_size=1,
                     grad_clip=self.train.grad_clip, precision=self.train.precision)

    def _timed_steps(self, batches: Sequence[Batch], opt, sched) -> Iterator[tuple[float, StepResult]]:
        """(seconds, result) per step of a timed pass, as west-train runs them; the seconds run from
        the previous step's figures on the host to this one's, so they sum to the pass. Read back:
        each step, then a device sync. ``train.late_readback``: each step queued while the one before
        still runs, whose figures are read once this one is queued; the last step's after a sync."""
        late, pending, last = self.train.late_readback, None, time.perf_counter()

        def lap() -> float:
            nonlocal last
            now = time.perf_counter()
            seconds, last = now - last, now
            return seconds

        for b in batches:
            if not late:
                res = self.step(b, opt, sched)
                self._sync()
                yield lap(), res
                continue
            queued = self.step(b, opt, sched, queue=queue_train_step)
            if pending is not None:
                res = pending.result()
                yield lap(), res
            pending = queued
        if pending is not None:
            self._sync()
            res = pending.result()
            yield lap(), res

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, batches: Sequence[Batch], warmup_steps: int) -> dict:
        cuda = self.device.type == "cuda"
        if cuda:   # the reserved peak is this mode's, not the cache an earlier mode or pass left
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        opt, sched = self.fresh(len(batches))
        for b in batches[:warmup_steps]:
            self.step(b, opt, sched)
        reserved = peak_reserved_mb(self.device)   # {} off CUDA; the warm-up's, before the reset below
        opt, sched = self.fresh(len(batches))
        gc.collect()
        monitor = build_monitor(self.device.type, self.device.index or 0)
        monitor.start()
        self._sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        allocator = AllocatorEvents(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        steps, losses, host = [], [], {k: 0.0 for k in HOST_SPLIT}
        for seconds, res in self._timed_steps(batches, opt, sched):
            steps.append(seconds)
            losses.append(res.loss)
            for k in HOST_SPLIT:
                host[k] += getattr(res, k)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        allocator_events = allocator.read()
        hw = monitor.read()
        monitor.stop()
        util = hw.get("gpu_busy_pct")
        if util is None:  # CPU sampler: 100 = one core; report the share of all cores
            util = hw.get("cpu_util_pct", float("nan")) / max(hw.get("cpu_count", 1.0), 1.0)
        return {"time_s": total, "cpu_s": cpu, "step_s": steps, "util_pct": util,
                "mean_loss": statistics.fmean(losses), "peak_mem_gib": self._peak_gib(),
                "peak_reserved_gib": self._peak_reserved_gib(reserved),
                "sm_pct": hw.get("gpu_sm_pct"), "allocator": allocator_events, **host}

    def _peak_gib(self) -> float:
        """CUDA: peak allocated by this pass. CPU: the process's peak RSS so far (never reset)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux

    def _peak_reserved_gib(self, warm: dict) -> Optional[float]:
        """CUDA: the most the caching allocator held over the warm-up (``warm``) and the timed pass,
        its cache and a replayed graph's pool included (which the allocated peak does not see)."""
        timed = peak_reserved_mb(self.device)
        if not timed:
            return None
        return max(warm["peak_reserved_mb"], timed["peak_reserved_mb"]) / 1024

    def profile_pass(self, batches: Sequence[Batch], rows: int = 20) -> tuple[dict, str]:
        """torch.profiler over one whole training pass: ({op: self ms}, table by input shape)."""
        from torch.profiler import ProfilerActivity, profile  # heavy

        opt, sched = self.fresh(len(batches))
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts, record_shapes=True) as prof:
            for b in batches:
                self.step(b, opt, sched)
            self._sync()
        key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        ops = {e.key: getattr(e, key) / 1000.0 for e in prof.key_averages()}
        table = prof.key_averages(group_by_input_shape=True).table(
            sort_by=key, row_limit=rows, max_name_column_width=45, max_shapes_column_width=90)
        return ops, table
