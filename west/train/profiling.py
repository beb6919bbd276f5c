"""Optional torch.profiler trace of a few training steps (``train.profile: true``).

The trace (DIR/profile/*.pt.trace.json, viewable in Perfetto / chrome://tracing
or TensorBoard's profiler plugin) shows per-kernel times; on CUDA the
TensorBoard plugin also reports the profiler's *estimated SM efficiency*,
the closest of our counters to an "SM utilisation" figure (see docs/training.md).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


class NullProfiler(contextlib.nullcontext):
    def __enter__(self) -> "NullProfiler":
        return self

    def step(self) -> None:
        pass


def build_profiler(enabled: bool, output_dir: str | Path, device_type: str = "cpu",
                   wait: int = 5, active: int = 5, rank: int = 0) -> Any:
    """A context manager with ``.step()``: records ``active`` steps after ``wait`` + 1 warmup."""
    if not enabled:
        return NullProfiler()
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler  # heavy

    activities = [ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    out = Path(output_dir) / "profile"
    out.mkdir(parents=True, exist_ok=True)
    return profile(activities=activities,
                   schedule=schedule(wait=wait, warmup=1, active=active, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(str(out), worker_name=f"rank{rank}"),
                   record_shapes=False, profile_memory=True, with_stack=False)
