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
  exact batches (CPU SDPA kernels registered below). Predicted time ∝ FLOPs, so the
  predicted speed-up of mode m over static is FLOPs(static) / FLOPs(m): the bound that
  removing padding allows when nothing else (per-step overhead, kernel efficiency at
  other shapes) changes.
"""
from __future__ import annotations

import gc
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from west.batch import IGNORE_INDEX, Batch
from west.data.config import DataConfig
from west.data.dataset import build_dataloader
from west.models.attention import SegmentPlan
from west.models.config import ConformerConfig
from west.shapes import subsampled_frames
from west.train.config import TrainConfig
from west.train.gpu_monitor import build_monitor
from west.train.loss import plan_step
from west.train.schedule import build_optimizer, build_scheduler
from west.train.step import train_step

# west.models.hf_attention.packed_kwargs groups packed LLM segments with 8 buckets per octave.
LLM_BUCKETS_PER_OCTAVE = 8
DEFAULT_MODES = ("static", "dynamic", "pack", "pack_encoder_padded")
ALL_MODES = DEFAULT_MODES + ("pack_nf",)


@dataclass(frozen=True)
class Mode:
    name: str
    method: str          # first column of the seed table
    configuration: str   # second column
    data: dict = field(default_factory=dict)   # DataConfig overrides


def standard_modes(names: Sequence[str] = DEFAULT_MODES, batch_size: int = 32, max_tokens: int = 4096,
                   pack_tokens: int = 8192) -> list[Mode]:
    """The seed table's modes plus the ablations, sized like the seed experiment by default."""
    pack = dict(batch_type="pack", pack_tokens=pack_tokens, pack_algorithm="bfd", encoder_layout="packed")
    table = {
        "static": Mode("static", "static batch", f"batch size {batch_size}",
                       dict(batch_type="static", batch_size=batch_size)),
        "dynamic": Mode("dynamic", "dynamic batch", f"max token in batch {max_tokens}",
                        dict(batch_type="dynamic", max_tokens_in_batch=max_tokens)),
        "pack": Mode("pack", "sequence pack", f"pack token {pack_tokens}, encoder packed", pack),
        "pack_encoder_padded": Mode("pack_encoder_padded", "pack, encoder padded (WEST)",
                                    f"pack token {pack_tokens}, encoder padded",
                                    {**pack, "encoder_layout": "padded"}),
        "pack_nf": Mode("pack_nf", "sequence pack, next-fit", f"pack token {pack_tokens}, next-fit",
                        {**pack, "pack_algorithm": "nf"}),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown benchmark mode(s) {unknown}; choose from {list(table)}")
    return [table[n] for n in names]


def select_utterances(data_list: str, n: int, out_path: Path, seed: int = 0) -> list[str]:
    """Write a jsonl list of ``n`` utterances drawn (seeded) from ``data_list``; returns their keys."""
    lines = [ln for ln in Path(data_list).read_text(encoding="utf-8").splitlines() if ln.strip()]
    keys = []
    for i, ln in enumerate(lines):
        try:
            keys.append(json.loads(ln)["key"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{data_list}:{i + 1}: the benchmark needs a jsonl list with a 'key' "
                             "per line (tools/prepare_aishell.py --jsonl writes one)") from None
    if n <= 0 or n > len(lines):
        raise ValueError(f"--num_utts {n}: {data_list} has {len(lines)} utterances")
    chosen = sorted(random.Random(seed).sample(range(len(lines)), n))
    out_path.write_text("".join(lines[i] + "\n" for i in chosen), encoding="utf-8")
    return [keys[i] for i in chosen]


def load_batches(data_list: str, tokenizer, conf: DataConfig, seed: int) -> tuple[list[Batch], float, dict]:
    """All batches of one training epoch in this mode, collated; (batches, seconds, skip counts)."""
    t0 = time.perf_counter()
    loader, dataset = build_dataloader(data_list, tokenizer, conf, seed=seed, epoch=0, training=True)
    batches = list(loader)
    return batches, time.perf_counter() - t0, dataset.stats.as_dict()


def _plan_cost(lengths: Sequence[int], buckets: Optional[int]) -> int:
    """Σ n² over the groups segment SDPA runs (each segment padded to its bucket length)."""
    plan = SegmentPlan.from_lengths(lengths, "cpu", buckets)
    return sum(int(g.index.shape[0]) * g.length ** 2 for g in plan.groups)


def batch_shapes(b: Batch, enc: ConformerConfig) -> dict:
    """What one batch holds (real) and what the model computes for it."""
    rows, width = (int(x) for x in b.input_ids.shape)
    out = {"rows": rows, "width": width, **{k: int(v) for k, v in b.counters.items()}}
    if b.is_packed:
        cu = b.cu_seqlens.long().tolist()
        segs = [e - s for s, e in zip(cu, cu[1:])]
        labels = b.labels.reshape(-1)
        lens = [e - s for s, e in zip(cu, cu[1:]) if bool((labels[s:e] != IGNORE_INDEX).any())]
        out["llm_attn_computed"] = _plan_cost(segs, LLM_BUCKETS_PER_OCTAVE)
        out["llm_attn_dense_segments"] = sum(n * n for n in segs)
    else:
        lens = b.attention_mask.sum(1).tolist()
        out["llm_attn_computed"] = out["llm_attn_dense_segments"] = rows * width * width
    out["llm_attn_real"] = sum(int(n) ** 2 for n in lens)
    feat_lens = b.feat_lens.tolist() if b.feat_lens is not None else []
    sub = [subsampled_frames(int(t), enc.subsampling_rate) for t in feat_lens]
    out["enc_sub_frames_real"] = sum(sub)
    out["enc_attn_real"] = sum(n * n for n in sub)
    if b.encoder_packed or not sub:
        out["enc_sub_frames_computed"] = sum(sub)
        out["enc_attn_computed"] = _plan_cost(sub, enc.buckets_per_octave)
    else:
        t = subsampled_frames(int(b.feats.shape[1]), enc.subsampling_rate)
        out["enc_sub_frames_computed"] = len(sub) * t
        out["enc_attn_computed"] = len(sub) * t * t
    return out


def _cpu_sdpa_flops() -> dict:
    """FLOP formulas for the CPU SDPA kernels, which torch.utils.flop_counter does not count."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def fwd(q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q, k, v)

    def bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, q, k, v)

    return {aten._scaled_dot_product_flash_attention_for_cpu: fwd,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd}


def count_flops(model: torch.nn.Module, batches: Sequence[Batch], device: torch.device) -> dict:
    """Forward+backward FLOPs over ``batches``: ``total``, ``forward``, ``backward`` and the
    forward FLOPs of each top-level part (``fwd_<child>``; the encoder is what the root's
    forward does outside its called children). Weights are not updated; this pass doubles
    as the warm-up that sees every batch shape once. (Per-module numbers come from forward
    hooks only: torch's attribution of backward ops to modules is approximate.)"""
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    root = type(model).__name__
    children = [name for name, _ in model.named_children()]
    out = {"total": 0, "forward": 0, "backward": 0, **{f"fwd_{c}": 0 for c in children}}
    for b in batches:
        fwd = FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_flops())
        bwd = FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_flops())
        with fwd:
            loss = model(b.to(device))["loss_sum"]
        with bwd:
            loss.backward()
        model.zero_grad(set_to_none=True)
        counts = fwd.get_flop_counts()
        called = 0
        for c in children:
            n = int(sum(counts.get(f"{root}.{c}", {}).values()))
            out[f"fwd_{c}"] += n
            called += n
        out["forward"] += int(fwd.get_total_flops())
        out["backward"] += int(bwd.get_total_flops())
        # a child the root calls through a method (not __call__) has no hook: its FLOPs are the rest
        rest = int(sum(counts.get(root, {}).values())) - called
        for c in children:
            if getattr(model, c) is not None and f"{root}.{c}" not in counts:
                out[f"fwd_{c}"] += rest
                break
    out["total"] = out["forward"] + out["backward"]
    return out


class PassRunner:
    """Timed training passes from one fixed initial state."""

    def __init__(self, model: torch.nn.Module, train: TrainConfig, device: torch.device, seed: int):
        self.model, self.train, self.device, self.seed = model, train, device, seed
        self.init = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def _fresh(self, n_steps: int):
        self.model.load_state_dict(self.init)
        self.model.train()
        torch.manual_seed(self.seed)
        t = self.train
        opt = build_optimizer(self.model, t.lr, t.weight_decay, t.betas, t.eps)
        return opt, build_scheduler(opt, t.warmup_steps, n_steps, t.min_lr_ratio)

    def step(self, b: Batch, opt, sched):
        return train_step(self.model, [b], plan_step([b], 1), opt, sched, device=self.device, world_size=1,
                          grad_clip=self.train.grad_clip, precision=self.train.precision)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, batches: Sequence[Batch], warmup_steps: int) -> dict:
        opt, sched = self._fresh(len(batches))
        for b in batches[:warmup_steps]:
            self.step(b, opt, sched)
        opt, sched = self._fresh(len(batches))
        gc.collect()
        monitor = build_monitor(self.device.type, self.device.index or 0)
        monitor.start()
        self._sync()
        t0, c0 = time.perf_counter(), time.process_time()
        steps, losses = [], []
        for b in batches:
            ts = time.perf_counter()
            losses.append(self.step(b, opt, sched).loss)
            self._sync()
            steps.append(time.perf_counter() - ts)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        hw = monitor.read()
        monitor.stop()
        util = hw.get("gpu_busy_pct")
        if util is None:  # CPU sampler: 100 = one core; report the share of all cores
            util = hw.get("cpu_util_pct", float("nan")) / max(hw.get("cpu_count", 1.0), 1.0)
        return {"time_s": total, "cpu_s": cpu, "step_s": steps, "util_pct": util,
                "mean_loss": statistics.fmean(losses)}

    def profile_pass(self, batches: Sequence[Batch], rows: int = 20) -> tuple[dict, str]:
        """torch.profiler over one whole training pass: ({op: self ms}, table by input shape)."""
        from torch.profiler import ProfilerActivity, profile

        opt, sched = self._fresh(len(batches))
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts, record_shapes=True) as prof:
            for b in batches:
                self.step(b, opt, sched)
            self._sync()
        ops = {e.key: e.self_cpu_time_total / 1000.0 for e in prof.key_averages()}
        table = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=45, max_shapes_column_width=90)
        return ops, table


def summarize(shapes: Sequence[dict]) -> dict:
    """Sum per-batch shapes into per-mode totals and ratios."""
    keys = [k for k in shapes[0] if k != "width"] if shapes else []
    tot = {k: sum(s[k] for s in shapes) for k in keys}
    tot["batches"] = len(shapes)
    ratio = lambda a, b: tot[a] / tot[b] if tot.get(b) else float("nan")  # noqa: E731
    tot["llm_useful"] = ratio("real_llm_tokens", "computed_llm_tokens")
    tot["enc_useful"] = ratio("real_enc_frames", "computed_enc_frames")
    tot["llm_attn_useful"] = ratio("llm_attn_real", "llm_attn_computed")
    tot["enc_attn_useful"] = ratio("enc_attn_real", "enc_attn_computed")
    if len(shapes) > 1:  # steady state: without the least-filled batch (an epoch's last, partial pack)
        worst = min(range(len(shapes)), key=lambda i: shapes[i]["real_llm_tokens"] / shapes[i]["computed_llm_tokens"])
        rest = [s for i, s in enumerate(shapes) if i != worst]
        tot["llm_useful_wo_least_filled"] = (sum(s["real_llm_tokens"] for s in rest)
                                             / sum(s["computed_llm_tokens"] for s in rest))
    return tot


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


def run_benchmark(model: torch.nn.Module, tokenizer, data_conf: DataConfig, train: TrainConfig,
                  data_list: str, modes: Sequence[Mode], repeats: int = 3,
                  warmup_steps: int = 1, seed: int = 0, device: str = "cpu",
                  profile: str = "auto", log=print) -> dict:
    """Load each mode's batches, count FLOPs, time ``repeats`` passes per mode; returns results.

    ``profile``: auto = profile the two modes of a speed-up check that falls below 90% of
    its FLOP prediction; always / never."""
    if profile not in ("auto", "always", "never"):
        raise ValueError(f"profile must be auto, always or never, got {profile!r}")
    dev = torch.device(device)
    model.to(dev)
    runner = PassRunner(model, train, dev, seed)
    enc_cfg = model.cfg.encoder
    loaded, results = {}, {}
    for m in modes:
        conf = data_conf.replace(**{**m.data, "num_workers": 0})
        batches, load_s, skipped = load_batches(data_list, tokenizer, conf, seed)
        keys = sorted(k for b in batches for k in b.keys)
        loaded[m.name] = batches
        shapes = [batch_shapes(b, enc_cfg) for b in batches]
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
        t0 = time.perf_counter()
        runner.model.load_state_dict(runner.init)
        results[m.name]["flops"] = count_flops(model, loaded[m.name], dev)
        log(f"[benchmark] {m.name}: FLOP count + warm-up pass {time.perf_counter() - t0:.1f} s")
    for rep in range(repeats):
        for m in modes:
            r = runner.run(loaded[m.name], warmup_steps)
            results[m.name].setdefault("runs", []).append(r)
            log(f"[benchmark] repeat {rep + 1}/{repeats} {m.name}: {r['time_s']:.2f} s (CPU {r['cpu_s']:.2f} s), "
                f"util {r['util_pct']:.0f}%, mean loss {r['mean_loss']:.3f}")
    for r in results.values():
        r["time_s"] = statistics.median(x["time_s"] for x in r["runs"])
        r["util_pct"] = statistics.median(x["util_pct"] for x in r["runs"])
        r["cpu_s"] = statistics.median(x["cpu_s"] for x in r["runs"])
        r["mean_loss"] = r["runs"][0]["mean_loss"]
    ref = "static" if "static" in results else modes[0].name
    compare(results, ref)
    checks = [c for c in (pairwise(results, "pack", ref), pairwise(results, "pack", "pack_encoder_padded")) if c]
    profiles: dict = {}
    for c in checks:
        c["below_90pct"] = c["ratio"] < 0.9
        if profile == "never" or (profile == "auto" and not c["below_90pct"]):
            continue
        for name in (c["fast"], c["slow"]):
            if name not in profiles:
                log(f"[benchmark] profiling one pass of {name}")
                profiles[name] = runner.profile_pass(loaded[name])
        c["profile"] = {"fast_ms": profiles[c["fast"]][0], "slow_ms": profiles[c["slow"]][0],
                        "fast_table": profiles[c["fast"]][1], "slow_table": profiles[c["slow"]][1]}
    runner.model.load_state_dict(runner.init)
    return {"modes": results, "checks": checks, "reference": ref}
