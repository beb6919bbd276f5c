"""Batch-mode benchmark: one model init, the same N utterances, every batch mode.

Per mode (static / dynamic / pack / pack with the encoder padded, optionally next-fit pack):

* **time**: one training pass over the N utterances through the production step
  (``west.train.step.train_step``: forward, backward, clip, AdamW). Batches are collated
  beforehand, so the time is the model's (the loader's time is reported on its own).
  Every pass starts from the same initial weights and a fresh optimizer; ``warmup_steps``
  steps run first and are not timed; repeats interleave the modes (round robin) so drifts
  in machine load hit every mode alike; the median is reported.
* **utilisation**: the monitor the trainer uses (``west.train.gpu_monitor``): on CPU this
  process's CPU time over the pass, reported as % of all cores; NVML busy % on CUDA.
* **compute performed**, from the batches: real vs computed LLM tokens and encoder fbank
  frames, attention terms Σ len² (real) vs what the kernels run (padded B·Lmax²; packed
  Σ over segments, incl. a row's dummy tail, bucketed as west's segment SDPA groups them).
* **cost model**: forward+backward FLOPs counted by ``torch.utils.flop_counter`` on the
  exact batches (west.bench.costs registers the CPU SDPA kernels). Predicted time ∝ FLOPs,
  so the predicted speed-up of mode m over static is FLOPs(static) / FLOPs(m): the bound that
  removing padding allows when nothing else (per-step overhead, kernel efficiency at
  other shapes) changes.
* **dispatched operators** (``count_ops``): every aten op one training pass dispatches, per step,
  split into forward / backward / optimizer / other, and the speech encoder's alone
  (west.bench.op_counter): the host work a step costs, a kernel-launch count on a GPU.

With a memory budget (west.bench.sizing) each mode first gets the largest size that fits;
``add_efficiency`` then adds the seed table's derived columns (time for 10,000 utterances,
TFLOP/s, MFU against a matrix-product peak measured in the same run).

The modes live in west.bench.modes, the timed passes in west.bench.runner, the tables in
west.bench.report; this module loads each mode's batches and runs the comparison.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Iterator, Optional, Sequence

import torch
import torch.utils.checkpoint

from west.batch import Batch
from west.bench.costs import batch_shapes, count_flops, step_time_fit, summarize
from west.bench.memory import cap_lifted
from west.bench.modes import WHISPER_PADDED, Mode, model_overrides
from west.bench.op_counter import count_encoder_ops, count_step_ops
from west.bench.runner import HOST_SPLIT, PassRunner
from west.data.config import DataConfig
from west.data.dataset import build_dataloader
from west.data.policies import POLICIES
from west.host_memory import keep_freed_host_memory
from west.models.static_encoder import StaticBlocks
from west.ranks import unwrap
from west.shapes import PackExtent, SpeechShape
from west.train.compile import compilations, compiled_regions
from west.train.config import TrainConfig
from west.train.encoder_graphs import encoder_shape, static_encoder_for


def load_batches(data_list: str, tokenizer, conf: DataConfig, shape: SpeechShape,
                 seed: int) -> tuple[list[Batch], float, dict]:
    """All batches of one training epoch in this mode, collated; (batches, seconds, skip counts)."""
    t0 = time.perf_counter()
    loader, dataset = build_dataloader(data_list, tokenizer, conf, shape, seed=seed, epoch=0, training=True)
    batches = list(loader)
    return batches, time.perf_counter() - t0, dataset.stats.as_dict()


TARGET_RATIO = 0.95   # a speed-up below 95% of what its FLOPs predict is profiled and flagged


def compare(results: dict, reference: str = "static") -> None:
    """Add measured and FLOP-predicted speed-ups (vs ``reference``) to every mode, in place."""
    ref = results[reference]
    for r in results.values():
        r["speedup"] = ref["time_s"] / r["time_s"]
        r["speedup_cpu_time"] = ref["cpu_s"] / r["cpu_s"]
        r["predicted_speedup"] = ref["flops"]["total"] / r["flops"]["total"]
        r["speedup_vs_predicted"] = r["speedup"] / r["predicted_speedup"]


def pairwise(results: dict, fast: str, slow: str) -> Optional[dict]:
    """Measured vs predicted speed-up of mode ``fast`` over mode ``slow``."""
    if fast not in results or slow not in results:
        return None
    f, s = results[fast], results[slow]
    measured, predicted = s["time_s"] / f["time_s"], s["flops"]["total"] / f["flops"]["total"]
    return {"fast": fast, "slow": slow, "measured": measured, "predicted": predicted,
            "ratio": measured / predicted, "measured_cpu_time": s["cpu_s"] / f["cpu_s"]}


def _prepared_key(mode: Mode, count_ops: bool) -> str:
    """What a mode's batches and counts depend on besides the run's fixed inputs: its sizes and overrides."""
    return repr((mode.name, sorted(mode.data.items()), sorted(mode.model.items()), count_ops))


class ModeOutOfMemory(RuntimeError):
    """A mode's timed pass ran out of memory (``mode`` names it); the model's weights are restored."""

    def __init__(self, mode: str, message: str):
        super().__init__(f"the timed pass of {mode} ran out of memory: {message}")
        self.mode = mode


def run_benchmark(model: torch.nn.Module, tokenizer, data_conf: DataConfig, train: TrainConfig,
                  data_list: str, modes: Sequence[Mode], repeats: int = 3,
                  warmup_steps: int = 1, seed: int = 0, device: str = "cpu",
                  profile: str = "auto", count_ops: bool = True, log=print,
                  prepared: Optional[dict] = None) -> dict:
    """Load each mode's batches, count FLOPs, time ``repeats`` passes per mode; returns results.

    ``profile``: auto = profile the two modes of a speed-up check that falls below
    ``TARGET_RATIO`` of its FLOP prediction; always / never. ``count_ops``: one more pass per
    mode with every dispatched operator counted (and the encoder's alone). ``prepared``: a dict
    kept across calls (a budget's retries after a timed pass ran out of memory): a mode whose
    size did not change keeps its batches, FLOP count and operator counts from the last call
    instead of loading and counting them again (about 20 s per mode at the seed's shapes)."""
    if profile not in ("auto", "always", "never"):
        raise ValueError(f"profile must be auto, always or never, got {profile!r}")
    dev = torch.device(device)
    host_allocator = keep_freed_host_memory() if dev.type == "cpu" else None
    if host_allocator:
        log(f"[benchmark] {host_allocator}")
    model.to(dev)
    runner = PassRunner(model, train, dev, seed)
    shape = model.cfg.speech_shape()
    buckets, packs_padded = model.encoder.attention_buckets, model.encoder.packs_padded_input
    full_window = shape.encoder_frames(shape.max_frames) if shape.max_frames else None
    loaded, results = {}, {}
    prepared = {} if prepared is None else prepared
    for key in set(prepared) - {_prepared_key(m, count_ops) for m in modes}:
        del prepared[key]   # a mode's old size: its pinned batches go
    for m in modes:
        reuse = prepared.get(_prepared_key(m, count_ops))
        if reuse is not None:
            loaded[m.name], results[m.name] = reuse[0], {**reuse[1], "configuration": m.configuration}
            log(f"[benchmark] {m.name}: batches, FLOP and operator counts as in the last attempt (same size)")
            continue
        conf = dataclasses.replace(data_conf, **{**m.data, "num_workers": 0})
        batches, load_s, skipped = load_batches(data_list, tokenizer, conf, shape, seed)
        if dev.type == "cuda":   # as the training loader with pin_memory gives them: copied without a sync
            batches = [b.pin_memory() for b in batches]
        keys = sorted(k for b in batches for k in b.keys)
        loaded[m.name] = batches
        padded = full_window if m.model.get("encoder.pad_to_30s") else None
        shapes = [batch_shapes(b, shape, buckets, padded, packs_padded) for b in batches]
        results[m.name] = {"method": m.method, "configuration": m.configuration, "data": m.data,
                           "load_s": load_s, "skipped": skipped, "keys": keys, "batches": shapes,
                           "totals": summarize(shapes)}
        log(f"[benchmark] {m.name}: {len(batches)} batches, {len(keys)} utterances, loaded in {load_s:.1f} s")
    first = results[modes[0].name]["keys"]
    for name, r in results.items():
        if r["keys"] != first:
            raise RuntimeError(f"mode {name} trained on other utterances than {modes[0].name} "
                               f"({len(r['keys'])} vs {len(first)}; skipped: {r['skipped']})")
    for m in modes:
        if "flops" in results[m.name]:   # counted in the last attempt
            continue
        t0 = time.perf_counter()
        runner.model.load_state_dict(runner.init)
        with model_overrides(model, m.model), cap_lifted(dev):
            results[m.name]["flops"] = count_flops(model, loaded[m.name], dev, train.precision)
        log(f"[benchmark] {m.name}: FLOP count + warm-up pass {time.perf_counter() - t0:.1f} s; "
            f"{results[m.name]['flops']['total'] / 1e12:.2f} TFLOP fwd+bwd")
        if count_ops:
            t0 = time.perf_counter()
            with model_overrides(model, m.model), cap_lifted(dev), \
                    graphed_encoder(model, m, train, dev, loaded[m.name]):
                results[m.name]["ops"] = count_step_ops(runner, loaded[m.name])
                results[m.name]["encoder_ops"] = count_encoder_ops(model, loaded[m.name], dev, train.precision)
            ops, enc = results[m.name]["ops"]["per_step"], results[m.name]["encoder_ops"]["per_step"]
            log(f"[benchmark] {m.name}: {ops['total']:.0f} dispatched ops per step (encoder alone {enc['total']:.0f}), "
                f"counted in {time.perf_counter() - t0:.1f} s")
        prepared[_prepared_key(m, count_ops)] = (loaded[m.name], dict(results[m.name]))
    with compiled_regions(model) if train.compile else contextlib.nullcontext(0) as n_compiled:
        if n_compiled:
            log(f"[benchmark] train.compile: {n_compiled} blocks compiled for the timed "
                "passes; the counts above ran eagerly")
        timed_passes(runner, model, modes, loaded, results, train, dev, repeats, warmup_steps, log)
    for r in results.values():
        r["time_s"] = statistics.median(x["time_s"] for x in r["runs"])
        r["util_pct"] = statistics.median(x["util_pct"] for x in r["runs"])
        r["cpu_s"] = statistics.median(x["cpu_s"] for x in r["runs"])
        r["mean_loss"] = r["runs"][0]["mean_loss"]
        r["peak_mem_gib"] = max(x["peak_mem_gib"] for x in r["runs"])
        reserved = [x["peak_reserved_gib"] for x in r["runs"] if x.get("peak_reserved_gib") is not None]
        r["peak_reserved_gib"] = max(reserved) if reserved else None
        sm = [x["sm_pct"] for x in r["runs"] if x.get("sm_pct") is not None]
        r["sm_pct"] = statistics.median(sm) if sm else None
        r["host_per_step_s"] = {k: statistics.fmean(x.get(k, math.nan) for x in r["runs"]) / len(r["batches"])
                                for k in HOST_SPLIT}
        per_step = [statistics.median(t) for t in zip(*(x["step_s"] for x in r["runs"]))]
        fit = step_time_fit(per_step, [b["computed_llm_tokens"] for b in r["batches"]])
        if fit is not None:
            r["step_time_fit"] = fit
        events = [x["allocator"] for x in r["runs"] if x.get("allocator")]   # CUDA caching-allocator events
        if events:   # per timed step (0 in a steady state)
            r["allocator_per_step"] = {k: statistics.fmean(e[k] for e in events) / len(r["batches"]) for k in events[0]}
        r["gflops_per_s"] = r["flops"]["total"] / 1e9 / r["time_s"]
        if train.compile:
            r["compilations"] = sum(x["compilations"] for x in r["runs"])
    ref = "static" if "static" in results else modes[0].name
    compare(results, ref)
    checks = [c for c in (pairwise(results, "pack", ref), pairwise(results, "pack", "dynamic"),
                          pairwise(results, "pack", "pack_encoder_padded")) if c]
    whisper = results.get(WHISPER_PADDED)
    if whisper and "pack" in results:   # the share of encoder compute that padding to 30 s costs
        results["pack"]["encoder_compute_removed_vs_30s"] = (
            1 - results["pack"]["flops"]["fwd_encoder"] / whisper["flops"]["fwd_encoder"])
    profiles: dict = {}
    for c in checks:
        c["below_target"] = c["ratio"] < TARGET_RATIO
        if profile == "never" or (profile == "auto" and not c["below_target"]):
            continue
        for name in (c["fast"], c["slow"]):
            if name not in profiles:
                log(f"[benchmark] profiling one pass of {name}")
                with model_overrides(model, next(m.model for m in modes if m.name == name)):
                    profiles[name] = runner.profile_pass(loaded[name])
        c["profile"] = {"fast_ms": profiles[c["fast"]][0], "slow_ms": profiles[c["slow"]][0],
                        "fast_table": profiles[c["fast"]][1], "slow_table": profiles[c["slow"]][1]}
    runner.model.load_state_dict(runner.init)
    return {"modes": results, "checks": checks, "reference": ref, "target_ratio": TARGET_RATIO,
            "host_allocator": host_allocator}


def timed_passes(runner: PassRunner, model: torch.nn.Module, modes: Sequence[Mode], loaded: dict, results: dict,
                 train: TrainConfig, dev: torch.device, repeats: int, warmup_steps: int, log) -> None:
    """``repeats`` timed passes of every mode in turn, into ``results[mode]["runs"]``; under
    ``train.compile`` also the graphs each mode's passes compiled (``compilations``: a shape the
    warm-up did not meet compiles inside the timed steps)."""
    for rep in range(repeats):
        for m in modes:
            before = compilations() if train.compile else 0   # (reading dynamo's counters imports it)
            try:
                with model_overrides(model, m.model), \
                        graphed_encoder(model, m, train, dev, loaded[m.name]) as encoder_static:
                    r = runner.run(loaded[m.name], warmup_steps)
                    if encoder_static is not None:
                        results[m.name]["encoder_graph"] = encoder_static.summary()
            except torch.OutOfMemoryError as e:   # the weights back as they were: the caller may retry
                runner.model.zero_grad(set_to_none=True)
                runner.model.load_state_dict(runner.init)
                raise ModeOutOfMemory(m.name, str(e).splitlines()[0]) from None
            except torch.utils.checkpoint.CheckpointError as e:   # which mode, after which: a replay that differs
                ran = [x.name for x in modes] if rep else [x.name for x in modes[:modes.index(m)]]
                raise RuntimeError(f"the timed pass of {m.name} (repeat {rep + 1}) failed in an activation "
                                   f"checkpoint's replay, after {', '.join(ran) or 'no other mode'} ran in this "
                                   f"process: {str(e).splitlines()[0]} (each mode alone: --modes {m.name})") from e
            if train.compile:
                r["compilations"] = compilations() - before
            results[m.name].setdefault("runs", []).append(r)
            log(f"[benchmark] repeat {rep + 1}/{repeats} {m.name}: {r['time_s']:.2f} s (CPU {r['cpu_s']:.2f} s), "
                f"util {r['util_pct']:.0f}%, mean loss {r['mean_loss']:.3f}")


@contextlib.contextmanager
def graphed_encoder(model: torch.nn.Module, mode: Mode, train: TrainConfig, device: torch.device,
                    batches: Sequence[Batch]) -> Iterator[Optional[StaticBlocks]]:
    """``train.encoder_graphs`` for one packed mode's passes, as west-train runs it: the Conformer's
    blocks on rows padded to one shape (sized by what the mode's fullest ``batches`` hold, as
    west-train's by its planned packs), captured on CUDA; unpadded again after. FLOPs are
    counted without it. Other modes and configs: unchanged."""
    if train.encoder_graphs != "true" or not POLICIES[mode.data["batch_type"]].packs_rows:
        yield None
        return
    speech = unwrap(model).cfg.speech_shape()
    frames = [[speech.encoder_frames(int(n)) for n in b.feat_lens.tolist()] for b in batches if b.feat_lens is not None]
    extent = PackExtent(max(map(sum, frames), default=0), max(map(len, frames), default=0),
                        max((max(f) for f in frames if f), default=0))
    shape, _ = encoder_shape(train, mode.data["pack_tokens"], unwrap(model).cfg.projector.stride, extent)
    static = static_encoder_for(model, shape, train.precision, device)
    try:
        yield static
    finally:
        unwrap(model).encoder.static_blocks = None


def add_efficiency(res: dict, peak: dict, per: int = 10_000) -> None:
    """The seed table's derived columns, in place: ``time_per_{per}_s`` (time × per / N, an
    extrapolation from the N utterances timed), ``tflops_per_s`` (counted FLOPs, padding
    included, over time) and ``mfu``: useful FLOP/s over ``peak`` (west.bench.peak). Useful
    FLOPs = the ``pack`` mode's count (real tokens and frames only, up to a pack's few pad
    tokens) less activation checkpointing's replay, the same work for every mode; without a pack
    mode, the smallest count of any mode."""
    modes = res["modes"]
    useful_from = "pack" if "pack" in modes else min(modes, key=lambda k: modes[k]["flops"]["total"])
    flops = modes[useful_from]["flops"]
    useful = flops["total"] - flops.get("replay", 0)
    for r in modes.values():
        r[f"time_per_{per}_s"] = r["time_s"] * per / res["num_utts"]
        r["tflops_per_s"] = r["flops"]["total"] / r["time_s"] / 1e12
        r["mfu"] = useful / r["time_s"] / 1e12 / peak["tflops"]
    res["efficiency"] = {"per_utts": per, "useful_flops_from": useful_from, "useful_flops": useful, "peak": peak}
