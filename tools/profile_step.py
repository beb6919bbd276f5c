#!/usr/bin/env python3
"""Where a training step's GPU waits for the host, per batch mode (GPU busy).

Runs the production step (``west.train.step.train_step``) on each mode's batches of the same N
utterances under torch.profiler, after warm-up steps, with named ranges around the step, the
model's forward, its encoder, projector and LLM decoder, and the optimizer step. From the trace
(west.lab.trace_gaps) it prints, per phase: host wall time, GPU operations launched, their GPU
time, and the GPU idle time each phase caused (the gaps its launches ended); then the host
operators behind the longest idle gaps. On a CPU the phases' host times alone. Not a test: a
table, a JSON, and the Chrome trace if asked for.

``--kernels_only`` (CUDA) records the GPU's kernels and the runtime calls alone: the host runs
nearly unslowed, and the idle gaps are split into host late and queued, by length
(west.lab.trace_gaps.kernel_timeline). ``--train.compile true`` profiles the step with the
repeated blocks compiled (west.train.compile); give enough ``--warmup_steps`` (4) for the
compilations to happen before the profiled steps. ``--train.encoder_graphs true`` profiles packed
modes with the Conformer's blocks replayed from CUDA graphs, as west-train runs them.

``--host_python`` runs the profiled steps under cProfile instead of torch.profiler: what the
launching thread does in Python, by function, per step (west.lab.host_profile).

``--phase_marks`` first runs the same steps with no profiler at all, marked at each phase boundary
(west.lab.phase_marks): per phase, the host's time, the GPU's, and how far the host was ahead
of the GPU at its start and end, so which phases the host paces once nothing slows it. Alone it
runs nothing else; with ``--host_python`` or ``--kernels_only``, those follow.

``--op_times`` runs the same steps unprofiled too, with the host's time in the projector, splice and
loss phases taken operator by operator and between operators, by line (west.lab.op_times): the
same tables as ``tools/train_op_times.py`` gives for west-train. Like ``--phase_marks``, alone it
runs nothing else.

``--single_thread_backward`` runs every step's backward on the launching thread
(``torch.autograd.set_multithreading_enabled(False)``) instead of autograd's thread per CUDA
device, so that cProfile or a sampling profiler of that thread (py-spy, ``tools/stack_summary.py``)
sees the backward too; its marks say whether the step's time changes with it.

    python tools/profile_step.py --config recipes/aishell/conf/seed_gpu.yaml --model.llm.path exp/seed_llm \\
        --data data/train/data.list --data.cmvn data/train/global_cmvn.json --modes pack,pack_encoder_padded \\
        --steps 3 --out profile.json [--trace_dir traces]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path
from typing import Iterator

from west.lab.host_profile import host_table, profile_calls, top_functions
from west.lab.op_times import PhaseOpTimes
from west.lab.op_times import table as op_times_table
from west.lab.phase_marks import StepClock
from west.lab.phase_table import lag_table, summarize
from west.lab.tool_setup import add_setup_args
from west.lab.trace_gaps import PREFIX, STEP, analyse, kernel_timeline, load_events, table, timeline_table
from west.train.phases import phase_hooks


@contextlib.contextmanager
def phase_ranges(model, optimizer) -> Iterator[None]:
    """``west:`` profiler ranges around the model's forward and its parts and the optimizer step
    (west.train.phases.phase_hooks: the production step is unchanged)."""
    from torch.profiler import record_function

    open_ranges = []

    def enter(name: str) -> None:
        r = record_function(PREFIX + name)
        r.__enter__()
        open_ranges.append(r)

    with phase_hooks(model, optimizer, enter, lambda name: open_ranges.pop().__exit__(None, None, None)):
        yield


def marked_steps(runner, batches, opt, sched) -> dict:
    """The steps unprofiled, with a mark at each phase boundary (west.lab.phase_marks): the
    host's and the GPU's time per phase and how far the host ran ahead of the GPU at each."""
    clock = StepClock(runner.device.type == "cuda")
    steps, waits = [], []
    for b in batches:
        with clock.around_step(runner.model, opt):
            res = runner.step(b, opt, sched)
        steps.append(clock.last)
        waits.append(res.sync_wait_s)
    out = summarize(steps, gpu=clock.cuda)
    out["read_back_wait_ms"] = 1e3 * statistics.median(waits)   # inside the "read-back" phase
    return out


def op_timed_steps(runner, batches, opt, sched) -> dict:
    """The steps unprofiled, the host's time in a few phases taken operator by operator
    (:class:`west.lab.op_times.PhaseOpTimes`; the first step left out)."""
    timer = PhaseOpTimes()
    for b in batches:
        with timer.hooks(runner.model, opt):
            runner.step(b, opt, sched)
    return timer.summary(skip=1 if len(batches) > 1 else 0)


def profile_mode(runner, batches, warmup: int, trace: Path, kernels_only: bool = False,
                 host_python: bool = False, phase_marks: bool = False, op_times: bool = False) -> dict:
    """Warm-up steps, then one profiled step per remaining batch; writes the Chrome trace to
    ``trace`` and returns its analysis: by phase, or with ``kernels_only`` (CUDA) the GPU's
    timeline alone, the host unslowed by operator recording; with ``host_python``, cProfile's
    top functions per step instead (no trace). ``phase_marks``: first the same batches unprofiled,
    marked at the phase boundaries (:func:`marked_steps`, under the result's "phase_marks"); with
    neither of the others, nothing else. ``op_times``: likewise, the host's time by operator in a few
    phases (:func:`op_timed_steps`, under "op_times")."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    opt, sched = runner.fresh(len(batches))
    for b in batches[:warmup]:
        runner.step(b, opt, sched)
    light = {}
    if phase_marks:
        light["phase_marks"] = marked_steps(runner, batches[warmup:], opt, sched)
    if op_times:
        light["op_times"] = op_timed_steps(runner, batches[warmup:], opt, sched)
    if light and not (host_python or kernels_only):
        runner.model.load_state_dict(runner.init)
        return light
    if host_python:
        def steps() -> None:
            for b in batches[warmup:]:
                runner.step(b, opt, sched)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
        stats, pauses = profile_calls(steps)
        runner.model.load_state_dict(runner.init)
        res = top_functions(stats, len(batches) - warmup, gc_pauses=pauses)
    else:
        if kernels_only:   # GPU events alone: no CPU operators and no ranges, whose recording slows the host
            acts, ranges, step_range = [ProfilerActivity.CUDA], contextlib.nullcontext(), contextlib.nullcontext
        else:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
            ranges, step_range = phase_ranges(runner.model, opt), lambda: record_function(STEP)
        with ranges, profile(activities=acts) as prof:
            for b in batches[warmup:]:
                with step_range():
                    runner.step(b, opt, sched)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
        prof.export_chrome_trace(str(trace))
        runner.model.load_state_dict(runner.init)
        events = load_events(trace)
        res = kernel_timeline(events, len(batches) - warmup) if kernels_only else analyse(events)
    return {**res, **light}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Any config key can be overridden as --section.key VALUE, as in west-train.")
    add_setup_args(p, modes="pack,pack_encoder_padded,static")
    p.add_argument("--steps", type=int, default=3, help="profiled steps per mode")
    p.add_argument("--warmup_steps", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON file for the analysis of every mode")
    p.add_argument("--trace_dir", default=None, help="keep each mode's Chrome trace here (MODE.json)")
    p.add_argument("--kernels_only", action="store_true",
                   help="CUDA: record the GPU's kernels and the runtime calls alone, not the CPU operators "
                        "(whose recording slows the host being measured): busy time, idle gaps by cause and length")
    p.add_argument("--host_python", action="store_true",
                   help="run the profiled steps under cProfile: the launching thread's Python time by function")
    p.add_argument("--single_thread_backward", action="store_true",
                   help="run the backward on the launching thread (torch.autograd.set_multithreading_enabled(False)) "
                        "instead of autograd's CUDA device thread: what a sampling profiler of that thread sees")
    p.add_argument("--phase_marks", action="store_true",
                   help="first run the profiled steps unprofiled, with a mark (a CUDA event) at each phase boundary: "
                        "the host's and the GPU's time per phase and how far the host was ahead; alone, only that")
    p.add_argument("--op_times", action="store_true",
                   help="run the steps unprofiled with the host's time in the projector, splice and loss phases "
                        "taken operator by operator and between operators, by line; alone, only that")
    args, rest = p.parse_known_args(argv)
    if args.kernels_only and args.host_python:
        p.error("--kernels_only and --host_python profile different things: give one")

    import torch

    from west.bench.benchmark import graphed_encoder
    from west.bench.modes import model_overrides
    from west.lab.tool_setup import tool_setup
    from west.ranks import cuda_allocator_defaults
    from west.train.compile import compilations, compile_regions

    cuda_allocator_defaults()
    work = Path(tempfile.mkdtemp())
    setup = tool_setup(args, rest, work / "profile_data.list")
    if args.kernels_only and setup.device.type != "cuda":
        print(f"[profile_step] --kernels_only needs a CUDA device (train.device is {setup.device.type}): "
              "a kernels-only trace has nothing but GPU events")
        return 2
    if setup.cfg.train.compile:
        print(f"[profile_step] train.compile: {compile_regions(setup.runner.model)} blocks compiled in place")
    traces = Path(args.trace_dir) if args.trace_dir else work
    traces.mkdir(parents=True, exist_ok=True)
    results = {}
    marks_only = (args.phase_marks or args.op_times) and not (args.host_python or args.kernels_only)
    for m in setup.modes:
        need = args.warmup_steps + args.steps
        batches = setup.batches(m, need)
        if len(batches) < need:   # few batches (big packs, few utterances): the warm-up reuses them
            print(f"[profile_step] {m.name}: {len(batches)} batches for {need} steps, taken in turn")
            batches = [batches[i % len(batches)] for i in range(need)]
        with model_overrides(setup.runner.model, m.model), \
                graphed_encoder(setup.runner.model, m, setup.cfg.train, setup.device, batches) as encoder_static:
            with torch.autograd.set_multithreading_enabled(not args.single_thread_backward):
                res = profile_mode(setup.runner, batches, args.warmup_steps, traces / f"{m.name}.json",
                                   args.kernels_only, args.host_python, args.phase_marks, args.op_times)
            if encoder_static is not None:   # train.encoder_graphs: the encoder's blocks replayed
                res["encoder_graph"] = encoder_static.summary()
        results[m.name] = res
        graphs = f", {compilations()} graphs compiled so far" if setup.cfg.train.compile else ""
        graphs += f", {res['encoder_graph']}" if "encoder_graph" in res else ""
        kind = ", kernels only" if args.kernels_only else ", Python on the launching thread" if args.host_python else ""
        graphs += ", backward on the launching thread" if args.single_thread_backward else ""
        if "phase_marks" in res:
            marks = res["phase_marks"]
            print(f"\n### {m.name} ({m.configuration}{graphs}, unprofiled, marked at phase boundaries)\n\n"
                  f"{lag_table(marks)}\n\nread-back wait {marks['read_back_wait_ms']:.1f} ms per step", flush=True)
        if "op_times" in res:
            print(f"\n### {m.name} ({m.configuration}{graphs}, unprofiled, the host's time by operator)\n\n"
                  f"{op_times_table(res['op_times'])}", flush=True)
        if marks_only:
            continue
        render = timeline_table if args.kernels_only else host_table if args.host_python else table
        print(f"\n### {m.name} ({m.configuration}{graphs}{kind})\n\n{render(res)}", flush=True)
    device = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu"
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__, "modes": results},
                                             indent=1), encoding="utf-8")
    if marks_only:
        def paced(t: dict) -> str:
            return (f"{t['host_paced_ms']:.0f} of {t['step_ms']:.0f} ms paced by the host" if t["gpu"]
                    else f"{t['step_ms']:.0f} ms per step (no GPU)")
        if args.phase_marks:
            print(f"[profile_step] {device}: " + ", ".join(f"{k} {paced(r['phase_marks'])}" for k, r in results.items()))
        if args.op_times:
            print(f"[profile_step] {device}: host ms per step in " + ", ".join(
                f"{k}: " + ", ".join(f"{p['phase']} {p['host_ms']:.1f}" for p in r["op_times"]["phases"])
                for k, r in results.items()))
        return 0 if results else 1
    if args.host_python:
        host = ", ".join(f"{k} {r['profiled_ms_per_step']:.0f} ms" for k, r in results.items())
        print(f"[profile_step] {device}: the launching thread's profiled time per step: {host}")
        return 0 if results else 1

    def pct(r: dict) -> str:
        return "n/a" if r["gpu_busy_pct"] is None else f"{r['gpu_busy_pct']:.0f} %"
    busy = ", ".join(f"{k} {pct(r)} ({r['step_ms']:.0f} ms per step)" for k, r in results.items())
    print(f"[profile_step] {device}: GPU busy {busy}")
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
