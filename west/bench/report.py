"""Tables (markdown), a bar chart (PNG) and the result files of west.bench.benchmark runs."""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
from pathlib import Path


def _fmt_time(s: float) -> str:
    m, sec = divmod(s, 60.0)
    return f"{int(m)} min {sec:.1f} s" if m >= 1 else f"{sec:.2f} s"


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}%"


def _big(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def seed_table(res: dict) -> str:
    """The seed's table: method, configuration, utilisation, time for N utterances, speed-up."""
    env = res["env"]
    util = ("GPU busy % (NVML)" if env["device"] == "cuda"
            else f"CPU util % (process CPU time / wall, psutil; 100 = all {env['cpu_count']} cores)")
    mem = "peak GPU memory allocated (reserved)" if env["device"] == "cuda" else "peak process RSS"
    sm = any(r.get("sm_pct") is not None for r in res["modes"].values())
    util = util + (" | NVML SM util % (process samples)" if sm else "")
    lines = [f"| method | configuration | {util} | time on training {res['num_utts']} utts | speed-up vs static "
             f"| achieved GFLOP/s | {mem} |", "|---|---|---|---|---|---|---|" + ("---|" if sm else "")]
    for r in res["modes"].values():
        u = f"{r['util_pct']:.1f}" + (f" | {r['sm_pct']:.1f}" if r.get("sm_pct") is not None
                                      else " | n/a" if sm else "")
        lines.append(f"| {r['method']} | {r['configuration']} | {u} | {_fmt_time(r['time_s'])} "
                     f"| {r['speedup']:.2f}x | {r.get('gflops_per_s', float('nan')):.1f} "
                     f"| {r.get('peak_mem_gib', float('nan')):.2f} GiB{_reserved(r)} |")
    return "\n".join(lines)


def _reserved(r: dict) -> str:
    """The GiB the CUDA caching allocator reserved at most in a mode's passes, in brackets: its cache and
    a replayed graph's pool included (the allocated peak misses what a replay writes there)."""
    gib = r.get("peak_reserved_gib")
    return f" ({gib:.2f})" if gib is not None else ""


def budget_table(res: dict) -> str:
    """The seed's table at the sizes a memory budget allows (west.bench.sizing): time for 10,000
    utterances extrapolated, utilisation, TFLOP/s, MFU, peak memory, dispatched ops per step."""
    env, eff, budget = res["env"], res["efficiency"], res.get("memory_budget")
    cuda = env["device"].startswith("cuda")
    per, n = eff["per_utts"], res["num_utts"]
    peak = eff["peak"]
    util = "GPU busy % (NVML) | SM % (NVML)" if cuda else f"CPU util % (100 = all {env['cpu_count']} cores)"
    mem = ("peak memory (CUDA allocated (reserved), timed pass)" if cuda
           else "peak memory (live tensor bytes, worst batch)")
    head = (f"| method | configuration | {util} | time on training {per:,} utts (extrapolated from {n}) "
            f"| achieved TFLOP/s | MFU (useful FLOP/s / {peak['tflops']:.2f} TFLOP/s {peak['dtype']} {peak['n']}³ mm) "
            f"| {mem} | dispatched ops per step |")
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    for name, r in res["modes"].items():
        u = (f"{r['util_pct']:.0f} | " + ("n/a" if r.get("sm_pct") is None else f"{r['sm_pct']:.0f}")) if cuda \
            else f"{r['util_pct']:.1f}"
        mem_b = r["peak_mem_gib"] * 2**30 if cuda else budget["search"][name]["peak_bytes"]
        ops = r.get("ops", {}).get("per_step", {}).get("total")
        lines.append(f"| {r['method']} | {r['configuration']} | {u} | {_fmt_time(r[f'time_per_{per}_s'])} "
                     f"| {r['tflops_per_s']:.3g} | {100 * r['mfu']:.1f}% | {mem_b / 2**30:.2f} GiB{_reserved(r)} "
                     f"| {'n/a' if ops is None else f'{ops:,.0f}'} |")
    return "\n".join(lines)


def budget_notes(res: dict) -> str:
    """How the sizes were found, and what the derived columns mean."""
    b, eff = res["memory_budget"], res["efficiency"]
    where = ("CUDA caching-allocator cap (torch.cuda.set_per_process_memory_fraction "
             f"{b['fraction']:.3f} of the card's {b['card'] / 2**30:.1f} GiB)" if b.get("card")
             else "host budget on live tensor storages (west.bench.memory.LiveTensorBytes: tensors returned by "
                  "dispatched ops plus the weights and the batch; not kernel temporaries, allocator slack or "
                  "the Python heap)")
    out = [f"- memory budget {b['text']} ({b['budget'] / 2**30:.2f} GiB): {where}"]
    for name, r in b["search"].items():
        tried = ", ".join(f"{t['size']}{'' if t['fits'] else ' OOM'}" for t in r["trials"])
        cap = " (the cap: all utterances in one batch)" if r["capped"] else ""
        out.append(f"- {name}: {r['key']} = {r['size']}{cap}; tried {tried}")
    out.append(f"- each trial: the production step on the worst batches at that size (most computed LLM "
               f"positions / LLM attention terms / encoder frames) from the initial weights with a fresh AdamW, "
               f"twice when one batch is the worst on all three; time = {res['num_utts']} utterances timed, "
               f"x {eff['per_utts']:,} / {res['num_utts']} (an extrapolation)")
    return "\n".join(out + [mfu_note(res)])


def mfu_note(res: dict) -> str:
    eff = res["efficiency"]
    return (f"- MFU = useful FLOPs ({eff['useful_flops_from']} mode's count: "
            f"{eff['useful_flops'] / 1e12:.2f} TFLOP) / time / the matrix-product peak measured in this run "
            f"({eff['peak']['tflops']:.2f} TFLOP/s, {eff['peak']['dtype']} {eff['peak']['n']}³, mean of "
            f"{eff['peak']['iters']}); achieved TFLOP/s counts every computed FLOP, padding included")


def ops_table(res: dict) -> str:
    """Dispatched aten operators per training step (west.bench.op_counter), and the encoder's alone."""
    lines = ["| method | steps | ops per step | forward | backward | optimizer | other (clip, scaling, schedule) "
             "| of which views | encoder alone per step: forward | backward | total |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["modes"].values():
        if "ops" not in r:
            continue
        o, e = r["ops"]["per_step"], r["encoder_ops"]["per_step"]
        lines.append(f"| {r['method']} | {r['ops']['steps']} | {o['total']:,.0f} | {o['forward']:,.0f} "
                     f"| {o['backward']:,.0f} | {o['optimizer']:,.0f} | {o['other']:,.0f} | {o['views']:,.0f} "
                     f"| {e['forward']:,.0f} | {e['backward']:,.0f} | {e['total']:,.0f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def compute_table(res: dict) -> str:
    """What each mode computes, and the speed-up the removed compute predicts."""
    lines = ["| method | batches | LLM tokens real / computed | LLM useful | enc frames real / computed "
             "| enc useful | LLM attn Σlen² / computed | enc attn Σlen² / computed | GFLOP fwd+bwd (fwd enc / LLM) "
             "| predicted speed-up | measured | measured / predicted | CPU s | speed-up by CPU time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["modes"].values():
        t = r["totals"]
        lines.append(
            f"| {r['method']} | {t['batches']} | {t['real_llm_tokens']} / {t['computed_llm_tokens']} "
            f"| {_pct(t['llm_useful'])} | {t['real_enc_frames']} / {t['computed_enc_frames']} "
            f"| {_pct(t['enc_useful'])} | {_big(t['llm_attn_real'])} / {_big(t['llm_attn_computed'])} "
            f"| {_big(t['enc_attn_real'])} / {_big(t['enc_attn_computed'])} | {r['flops']['total'] / 1e9:.1f} "
            f"({r['flops']['fwd_encoder'] / 1e9:.1f} / {r['flops']['fwd_llm'] / 1e9:.1f}) "
            f"| {r['predicted_speedup']:.2f}x | {r['speedup']:.2f}x | {100 * r['speedup_vs_predicted']:.0f}% "
            f"| {r['cpu_s']:.1f} | {r['speedup_cpu_time']:.2f}x |")
    return "\n".join(lines)


def _headline(res: dict) -> list[str]:
    """The lines west-benchmark prints under its table: packing's useful share, the regime, each
    speed-up against its FLOP prediction."""
    out = []
    pack = res["modes"].get("pack")
    if pack:
        t = pack["totals"]
        ok = "met" if min(t["llm_useful"], t["enc_useful"]) >= 0.995 else "MISSED"
        out.append(f"- pack useful LLM tokens {_pct(t['llm_useful'])}, encoder frames {_pct(t['enc_useful'])} "
                   f"(target >= 99.50%: {ok})")
    if pack and pack["flops"]["fwd_encoder"] > 0:
        f = pack["flops"]
        out.append(f"- regime: the LLM's forward FLOPs are {f['fwd_llm'] / f['fwd_encoder']:.1f}x the encoder's "
                   f"(pack; {'LLM' if f['fwd_llm'] >= f['fwd_encoder'] else 'encoder'}-heavy)")
    target = f"{100 * res['target_ratio']:.0f}%"
    for c in res["checks"]:
        verdict = (f"BELOW {target} of the prediction: profile in {c.get('profile_file', '(not written)')}"
                   if c["below_target"] else f"at least {target} of the prediction")
        out.append(f"- {c['fast']} over {c['slow']}: measured {c['measured']:.2f}x, FLOPs predict "
                   f"{c['predicted']:.2f}x -> {100 * c['ratio']:.0f}% ({verdict}); by CPU time "
                   f"{c['measured_cpu_time']:.2f}x")
    return out


def _machine(res: dict) -> str:
    env = res["env"]
    gpu = f" ({env['gpu']})" if env.get("gpu") else ""
    return (f"- machine: {env['cpu_model']}, {env['cpu_count']} cores, torch {env['torch']} "
            f"({env['threads']} threads), device {env['device']}{gpu}; load average {env['load_before']} before, "
            f"{env['load_after']} after; {env['date']}")


def summary(res: dict) -> str:
    """What west-benchmark prints: the seed's table and a few lines; benchmark.md has the rest."""
    table = budget_table(res) if res.get("memory_budget") or res.get("efficiency") else seed_table(res)
    return "\n\n".join([table, "\n".join([*_headline(res), _machine(res)])])


def notes(res: dict) -> str:
    """Targets, the speed-up checks, and what the numbers mean."""
    out = _headline(res)
    pack = res["modes"].get("pack")
    if pack and "llm_useful_wo_least_filled" in pack["totals"]:
        out.insert(1, f"- pack LLM useful without the least-filled pack (the epoch's last, partial one): "
                      f"{_pct(pack['totals']['llm_useful_wo_least_filled'])}")
    removed = (pack or {}).get("encoder_compute_removed_vs_30s")
    if removed is not None:
        out.append(f"- encoder compute removed by packing the encoder input instead of padding every utterance to 30 s: "
                   f"{100 * removed:.1f}% of the encoder's forward FLOPs")
    split = [f"{name} {1e3 * h['launch_s']:.0f} / {1e3 * h['sync_wait_s']:.0f} / {1e3 * h['update_s']:.0f}"
             for name, r in res["modes"].items() if (h := r.get("host_per_step_s"))]
    if split:
        out.append("- host ms per step, queueing forward+backward+clip / blocked in the step's one read-back / "
                   "queueing the update (a read-back wait near 0 on a GPU: the host paces the step): "
                   + "; ".join(split))
    fits = [f"{name} {1e3 * f['fixed_s']:.0f} ms + {1e6 * f['per_token_s']:.2f} us/token ({f['steps']} steps)"
            for name, r in res["modes"].items() if (f := r.get("step_time_fit"))]
    if fits:
        out.append("- step time fitted as fixed + per computed LLM token (least squares over each mode's timed "
                   "steps; the fixed part does not shrink with a batch, so a partial last batch weighs on a "
                   "short pass): " + "; ".join(fits))
    allocs = [f"{name} " + ", ".join(f"{k} {v:.1f}" for k, v in a.items())
              for name, r in res["modes"].items() if (a := r.get("allocator_per_step"))]
    if allocs:
        out.append("- CUDA caching-allocator events per timed step (device allocations and frees, retries after "
                   "a cache flush: 0 in a steady state; more under a tight memory cap is the allocator's time, "
                   "not the kernels'): " + "; ".join(allocs))
    graphs = [f"{name}: {r['encoder_graph']}" for name, r in res["modes"].items() if r.get("encoder_graph")]
    if graphs:
        out.append("- train.encoder_graphs (the Conformer's blocks replayed; the rows' padding is not in the FLOP "
                   "counts): " + "; ".join(graphs))
    compiled = [f"{name} {r['compilations']}" for name, r in res["modes"].items() if "compilations" in r]
    if compiled:
        out.append("- train.compile (the timed passes' repeated blocks compiled; FLOP and operator counts and any "
                   "size search ran eagerly), graphs compiled over each mode's passes: " + ", ".join(compiled))
    out.append(f"- time = median of {res['repeats']} passes (forward + backward + clip + AdamW, batches "
               f"collated beforehand, {res['warmup_steps']} warm-up step(s) untimed, same initial weights); "
               f"predicted speed-up = FLOPs(static) / FLOPs(mode), FLOPs counted by torch.utils.flop_counter "
               f"on the exact batches")
    out.append(_machine(res))
    if res.get("host_allocator"):
        out.append(f"- {res['host_allocator']} (west/host_memory.py)")
    return "\n".join(out)


def profile_diff(c: dict, rows: int = 12) -> str:
    """Ops by how much more self time the faster-by-FLOPs mode spends in them (same N utterances)."""
    fast, slow = c["profile"]["fast_ms"], c["profile"]["slow_ms"]
    ops = sorted(set(fast) | set(slow), key=lambda k: fast.get(k, 0.0) - slow.get(k, 0.0), reverse=True)
    lines = [f"| op (self time: CPU ops, or CUDA kernels on a GPU; one pass over the same utterances) | {c['fast']} ms | {c['slow']} ms "
             f"| {c['fast']} − {c['slow']} ms |", "|---|---|---|---|"]
    for k in ops[:rows]:
        lines.append(f"| {k} | {fast.get(k, 0.0):.0f} | {slow.get(k, 0.0):.0f} | {fast.get(k, 0.0) - slow.get(k, 0.0):+.0f} |")
    lines.append(f"| **all ops** | {sum(fast.values()):.0f} | {sum(slow.values()):.0f} "
                 f"| {sum(fast.values()) - sum(slow.values()):+.0f} |")
    return "\n".join(lines)


def profile_report(c: dict, prof: dict) -> str:
    """The profile file written when a measured speed-up is below the target share of its FLOP prediction."""
    c = {**c, "profile": prof}
    return (f"# Why {c['fast']} is not {c['predicted']:.2f}x faster than {c['slow']} (measured {c['measured']:.2f}x)\n\n"
            f"{profile_diff(c, rows=25)}\n\n## {c['fast']}: top ops by input shape\n\n```\n{prof['fast_table']}\n```\n\n"
            f"## {c['slow']}: top ops by input shape\n\n```\n{prof['slow_table']}\n```\n")


def report(res: dict) -> str:
    parts = [seed_table(res), compute_table(res), notes(res)]
    ops = ops_table(res)
    if ops:
        parts.insert(2, "Dispatched aten operators per training step (forward + backward + optimizer, "
                        "west.bench.op_counter; the encoder alone on the same batches):\n\n" + ops)
    if res.get("memory_budget"):
        parts[:0] = [budget_table(res), budget_notes(res)]
    elif res.get("efficiency"):   # fixed sizes on a GPU: the same table, MFU against the peak measured here
        parts[:0] = [budget_table(res), mfu_note(res)]
    for c in res["checks"]:
        if c.get("profile_file"):
            parts.append(f"Where {c['fast']} loses against {c['slow']} (top of {c['profile_file']}):\n\n"
                         + c["profile_top"])
    return "\n\n".join(parts)


def plot(res: dict, path: Path) -> None:
    """Two panels: time per mode (speed-up annotated) and useful LLM/encoder share."""
    import matplotlib  # heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy

    modes = list(res["modes"].values())
    names = [r["method"].replace(" (WEST)", "\n(WEST)").replace(", ", ",\n") for r in modes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    times = [r["time_s"] for r in modes]
    bars = a.bar(names, times, color=["#888888", "#5b8fd9", "#2ca02c", "#d98b5b", "#9467bd"][:len(modes)])
    for bar, r in zip(bars, modes):
        a.annotate(f"{r['speedup']:.2f}x\n(FLOPs: {r['predicted_speedup']:.2f}x)",
                   (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    a.set_ylabel(f"seconds to train {res['num_utts']} utterances")
    a.set_title(f"Training time per batch mode ({res['env']['device']})")
    a.set_ylim(0, max(times) * 1.3)
    x = range(len(modes))
    w = 0.38
    b.bar([i - w / 2 for i in x], [100 * r["totals"]["llm_useful"] for r in modes], w, label="LLM tokens")
    b.bar([i + w / 2 for i in x], [100 * r["totals"]["enc_useful"] for r in modes], w, label="encoder frames")
    b.set_xticks(list(x))
    b.set_xticklabels(names)
    b.set_ylabel("useful (real / computed) %")
    b.set_ylim(0, 110)
    b.legend(loc="lower right")
    b.set_title("Share of computed positions that are real")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine(device: str) -> dict:
    """Where the numbers were taken: CPU, cores, torch and its threads, load before the run."""
    import torch  # heavy

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(torch.device(device)) if str(device).startswith("cuda") else None
    return {"cpu_model": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__, "gpu": gpu,
            "threads": torch.get_num_threads(), "device": device, "python": platform.python_version(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "load_before": [round(x, 2) for x in os.getloadavg()]}


def save(res: dict, out: Path) -> str:
    """Write a profile file per profiled check, then benchmark.{json,md,png} into ``out``;
    each mode's utterance keys are kept as one SHA-1 (the same set in every mode). Returns
    what the console gets (:func:`summary`)."""
    for c in res["checks"]:
        prof = c.pop("profile", None)
        if prof is not None:
            path = out / f"profile_{c['fast']}_vs_{c['slow']}.md"
            path.write_text(profile_report(c, prof), encoding="utf-8")
            c["profile_file"] = str(path)
            c["profile_top"] = profile_diff({**c, "profile": prof})
    for r in res["modes"].values():
        r["utterances_sha1"] = hashlib.sha1("\n".join(r.pop("keys")).encode()).hexdigest()
    text = report(res)
    (out / "benchmark.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    (out / "benchmark.md").write_text(text + "\n", encoding="utf-8")
    plot(res, out / "benchmark.png")
    return summary(res)
