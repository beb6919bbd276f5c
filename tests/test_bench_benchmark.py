"""west.bin.benchmark: every batch mode trains on the same utterances, and what it reports
(counters, attention terms, FLOPs, speed-ups, table, JSON, PNG) is consistent."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from west.bench.costs import step_time_fit
from west.bench.modes import ALL_MODES, standard_modes
from west.bin import benchmark as cli

from helpers.e2e import bench_setup

N, BATCH, MAX_TOKENS, PACK = 16, 4, 256, 512


@pytest.fixture(scope="module")
def setup(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("bench")
    llm, conf = bench_setup(d, corpus["texts"].values())
    return {"dir": d, "llm": llm, "conf": conf, "list": corpus["list"]}


def args(setup, out, *extra):
    return ["--config", str(setup["conf"]), "--model.llm.path", str(setup["llm"]), "--data", str(setup["list"]),
            "--out_dir", str(out), *extra]


@pytest.fixture(scope="module")
def result(setup):
    out = setup["dir"] / "out"
    threads = torch.get_num_threads()   # --threads sets a process-wide torch setting
    rc = cli.main(args(setup, out, "--num_utts", str(N), "--modes", ",".join(ALL_MODES), "--repeats", "1",
                       "--batch_size", str(BATCH), "--max_tokens_in_batch", str(MAX_TOKENS),
                       "--pack_tokens", str(PACK), "--profile", "always", "--threads", "1"))
    torch.set_num_threads(threads)
    assert rc == 0
    return out, json.loads((out / "benchmark.json").read_text(encoding="utf-8"))


def test_outputs_written(result):
    out, res = result
    assert set(res["modes"]) == set(ALL_MODES)
    assert (out / "benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "benchmark.md").read_text(encoding="utf-8")
    assert md.startswith("| method | configuration | CPU util %")
    for r in res["modes"].values():
        assert f"| {r['method']} | {r['configuration']} |" in md
    assert res["num_utts"] == N and len((out / "bench_data.list").read_text().splitlines()) == N
    assert res["env"]["device"] == "cpu" and res["command"].startswith("python -m west.bin.benchmark")
    for name, r in res["modes"].items():   # the host's split of a step: queueing it, then the update
        h = r["host_per_step_s"]
        assert h["launch_s"] > 0 and h["update_s"] > 0 and h["sync_wait_s"] >= 0, name
        assert h["launch_s"] + h["sync_wait_s"] + h["update_s"] <= r["time_s"] / len(r["batches"]) * 1.01, name
    assert "- host ms per step, queueing forward+backward+clip" in md
    assert not any("allocator_per_step" in r for r in res["modes"].values()) and "caching-allocator" not in md
    # the host's clocks are the lab's (west.lab.host_clock): the benchmark reads none
    assert not any("host_clock_per_step" in r for r in res["modes"].values()) and "host_clock" not in md


def test_fixed_sizes_on_a_gpu_print_the_seed_table(result):
    """Without --memory_budget a CUDA run still measures the matmul peak and prints the seed's table
    (time for 10,000 utterances, MFU), as for the sizes a budget finds."""
    import copy

    from west.bench.benchmark import add_efficiency
    from west.bench.report import report

    res = copy.deepcopy(result[1])
    assert "memory_budget" not in res and "efficiency" not in res   # a CPU run at fixed sizes: no MFU
    res["env"]["device"] = "cuda:0"
    for r in res["modes"].values():   # a CPU run records no reserved peak
        assert r["peak_reserved_gib"] is None
    res["modes"]["pack"]["peak_reserved_gib"] = 12.345
    add_efficiency(res, {"tflops": 100.0, "n": 8192, "dtype": "bfloat16", "iters": 10})
    text = report(res)
    assert text.startswith("| method | configuration | GPU busy % (NVML) | SM % (NVML) | time on training 10,000")
    assert "| peak memory (CUDA allocated (reserved), timed pass) |" in text
    pack_row = next(line for line in text.splitlines() if line.startswith(f"| {res['modes']['pack']['method']} |"))
    assert " GiB (12.35) |" in pack_row   # the allocator's reserved peak beside the allocated one
    assert "MFU (useful FLOP/s / 100.00 TFLOP/s bfloat16 8192³ mm)" in text and "\n- MFU = useful FLOPs" in text
    assert "- memory budget" not in text
    for r in res["modes"].values():
        assert f"| {r['method']} | {r['configuration']} |" in text.split("\n\n")[0]


def test_same_utterances_and_real_work_in_every_mode(result):
    _, res = result
    modes = list(res["modes"].values())
    assert len({r["utterances_sha1"] for r in modes}) == 1
    same = ("utterances", "label_tokens", "real_enc_frames", "enc_attn_real", "enc_sub_frames_real")
    for key in same:
        assert len({r["totals"][key] for r in modes}) == 1, key
    whole = [r for name, r in res["modes"].items() if name != "pack_shared_prefix"]
    for key in ("real_llm_tokens", "llm_attn_real"):
        assert len({r["totals"][key] for r in whole}) == 1, key
        # the prompt's prefix once per pack: fewer LLM tokens for the same utterances
        assert res["modes"]["pack_shared_prefix"]["totals"][key] < whole[0]["totals"][key], key
    assert modes[0]["totals"]["utterances"] == N


def test_counters_match_batch_shapes(result):
    _, res = result
    m = res["modes"]
    for name in ("static", "dynamic"):
        bs = m[name]["batches"]
        assert all(b["computed_llm_tokens"] == b["rows"] * b["width"] for b in bs)
        assert m[name]["totals"]["computed_llm_tokens"] == sum(b["rows"] * b["width"] for b in bs)
        assert m[name]["totals"]["llm_attn_computed"] == sum(b["rows"] * b["width"] ** 2 for b in bs)
        assert all(b["rows"] == b["utterances"] for b in bs)
    assert all(b["utterances"] <= BATCH for b in m["static"]["batches"])
    assert all(b["rows"] * b["width"] <= MAX_TOKENS for b in m["dynamic"]["batches"])
    for name in ("pack", "pack_encoder_padded", "pack_nf"):
        t = m[name]["totals"]
        bs = m[name]["batches"]
        assert t["computed_llm_tokens"] == sum(b["rows"] * b["width"] for b in bs)
        # rows hold at most PACK tokens; a batch is as wide as its longest row rounded up to 8
        assert all(b["real_llm_tokens"] <= b["rows"] * b["width"] and b["width"] <= PACK for b in bs)
        assert all(b["width"] == min(PACK, -(-b["real_llm_tokens"] // 8) * 8) for b in bs if b["rows"] == 1)
        assert t["real_llm_tokens"] <= t["computed_llm_tokens"]
        # packed segments (with the dummy tail) never cost more than the dense row
        assert t["llm_attn_real"] <= t["llm_attn_computed"] <= t["llm_attn_dense_segments"] * (1 + 1 / 8) ** 2
    for name in ("pack", "pack_nf"):   # packed encoder: nothing but real frames
        t = m[name]["totals"]
        assert t["computed_enc_frames"] == t["real_enc_frames"]
        assert t["enc_sub_frames_computed"] == t["enc_sub_frames_real"]
    padded = m["pack_encoder_padded"]["totals"]
    assert padded["computed_enc_frames"] > padded["real_enc_frames"]
    assert m["pack"]["totals"]["batches"] == m["pack_encoder_padded"]["totals"]["batches"]
    assert m["pack"]["totals"]["enc_useful"] == 1.0


def test_flops_and_speedups(result):
    _, res = result
    m = res["modes"]
    # identical LLM rows, different encoder layout: same LLM FLOPs, more encoder FLOPs when padded
    assert m["pack"]["flops"]["fwd_llm"] == m["pack_encoder_padded"]["flops"]["fwd_llm"] > 0
    assert m["pack_encoder_padded"]["flops"]["fwd_encoder"] > m["pack"]["flops"]["fwd_encoder"] > 0
    for r in m.values():
        f = r["flops"]
        assert f["total"] == f["forward"] + f["backward"]
        assert f["forward"] == f["fwd_encoder"] + f["fwd_projector"] + f["fwd_llm"]
        assert r["speedup"] == pytest.approx(m["static"]["time_s"] / r["time_s"])
        assert r["predicted_speedup"] == pytest.approx(m["static"]["flops"]["total"] / f["total"])
        assert r["time_s"] > 0 and len(r["runs"]) == 1 and len(r["runs"][0]["step_s"]) == r["totals"]["batches"]
    assert m["static"]["speedup"] == m["static"]["predicted_speedup"] == 1.0
    checks = {(c["fast"], c["slow"]) for c in res["checks"]}
    assert checks == {("pack", "static"), ("pack", "dynamic"), ("pack", "pack_encoder_padded")}
    for c in res["checks"]:   # --profile always: a profile comparison for every check
        text = Path(c["profile_file"]).read_text(encoding="utf-8")
        assert "| op (self time" in text and "**all ops**" in text


def test_dispatched_operators_per_mode(result):
    """Every mode reports the ops its steps dispatch, by phase, and its encoder's alone."""
    out, res = result
    for r in res["modes"].values():
        o, e = r["ops"], r["encoder_ops"]
        assert o["steps"] == e["steps"] == r["totals"]["batches"]
        per = o["per_step"]
        assert per["total"] == sum(per[p] for p in ("forward", "backward", "optimizer", "other"))
        assert min(per["forward"], per["backward"], per["optimizer"]) > 0 and per["views"] < per["total"]
        assert o["pass"]["total"] == pytest.approx(per["total"] * o["steps"])
        assert e["per_step"]["optimizer"] == e["per_step"]["other"] == 0
        assert 0 < e["per_step"]["forward"] < per["forward"] and 0 < e["per_step"]["backward"] < per["backward"]
    m = res["modes"]
    # the same LLM rows and optimizer: the two pack modes differ in the encoder only
    assert m["pack"]["ops"]["per_step"]["optimizer"] == m["pack_encoder_padded"]["ops"]["per_step"]["optimizer"]
    md = (out / "benchmark.md").read_text(encoding="utf-8")
    assert "Dispatched aten operators per training step" in md
    for r in m.values():
        assert f"| {r['method']} | {r['ops']['steps']} | {r['ops']['per_step']['total']:,.0f} |" in md


def test_step_time_fit_in_the_json_and_notes(result):
    """Each mode with 3+ timed steps of sizes 20 % apart gets time = fixed + per-token, fitted to its own
    per-step times (the median over passes) against its batches' computed LLM positions."""
    out, res = result
    md = (out / "benchmark.md").read_text(encoding="utf-8")
    fitted = {name: r for name, r in res["modes"].items() if "step_time_fit" in r}
    assert fitted, {name: [b["computed_llm_tokens"] for b in r["batches"]] for name, r in res["modes"].items()}
    for name, r in fitted.items():
        f, tokens = r["step_time_fit"], [b["computed_llm_tokens"] for b in r["batches"]]
        assert f == pytest.approx(step_time_fit(r["runs"][0]["step_s"], tokens))   # one pass: its own times
        assert f"{name} {1e3 * f['fixed_s']:.0f} ms + {1e6 * f['per_token_s']:.2f} us/token ({len(tokens)} steps)" in md


def test_modes_and_bad_arguments(setup, tmp_path):
    assert [m.name for m in standard_modes()] == ["static", "dynamic", "pack", "pack_encoder_padded"]
    assert standard_modes(["pack_encoder_padded"])[0].data["encoder_layout"] == "padded"
    assert cli.main(args(setup, tmp_path / "a", "--num_utts", "1000")) == 2
    assert cli.main(args(setup, tmp_path / "b", "--num_utts", "4", "--modes", "static,bogus")) == 2
    bad = tmp_path / "bad.list"
    bad.write_text("utt1 /x.wav\n", encoding="utf-8")
    assert cli.main(["--config", str(setup["conf"]), "--model.llm.path", str(setup["llm"]), "--data", str(bad),
                     "--num_utts", "1", "--out_dir", str(tmp_path / "c")]) == 2


def test_compiled_timed_passes_train_as_the_eager_ones(setup, tmp_path):
    """train.compile in the benchmark: the timed passes run the compiled blocks (the same mean loss as
    eager), the report counts the graphs compiled per mode, and the FLOP counts stay the eager ones."""
    common = ["--num_utts", "6", "--repeats", "1", "--pack_tokens", str(PACK), "--profile", "never", "--threads", "1",
              "--modes", "pack", "--no-count_ops"]
    threads = torch.get_num_threads()
    try:
        assert cli.main(args(setup, tmp_path / "plain", *common)) == 0
        assert cli.main(args(setup, tmp_path / "compiled", *common, "--train.compile", "true")) == 0
    finally:
        torch.set_num_threads(threads)
    plain, compiled = (json.loads((tmp_path / n / "benchmark.json").read_text(encoding="utf-8"))["modes"]["pack"]
                       for n in ("plain", "compiled"))
    assert "compilations" not in plain and compiled["compilations"] >= 1
    assert compiled["flops"] == plain["flops"]
    assert compiled["mean_loss"] == pytest.approx(plain["mean_loss"], rel=1e-4)
    md = (tmp_path / "compiled" / "benchmark.md").read_text(encoding="utf-8")
    assert f"graphs compiled over each mode's passes: pack {compiled['compilations']}" in md


def test_allocator_events_per_timed_step_are_reported(setup, tmp_path, monkeypatch):
    """On CUDA each timed pass reads the caching allocator's events (a stand-in here: 6 device
    allocations, 2 frees and 1 flush-and-retry per pass): the JSON gives them per step, the notes
    say them. A CPU pass has none and says nothing."""
    import west.bench.runner as runner

    class FakeEvents:
        def __init__(self, device):
            pass

        def read(self):
            return {"device_allocs": 6, "device_frees": 2, "alloc_retries": 1}

    monkeypatch.setattr(runner, "AllocatorEvents", FakeEvents)
    threads = torch.get_num_threads()
    try:
        assert cli.main(args(setup, tmp_path, "--num_utts", "6", "--repeats", "2", "--pack_tokens", "256",
                             "--profile", "never", "--threads", "1", "--modes", "pack", "--no-count_ops")) == 0
    finally:
        torch.set_num_threads(threads)
    r = json.loads((tmp_path / "benchmark.json").read_text(encoding="utf-8"))["modes"]["pack"]
    n = len(r["batches"])
    assert n > 1 and r["allocator_per_step"] == pytest.approx(
        {"device_allocs": 6 / n, "device_frees": 2 / n, "alloc_retries": 1 / n})
    md = (tmp_path / "benchmark.md").read_text(encoding="utf-8")
    assert f"retries after a cache flush: 0 in a steady state; more under a tight memory cap is the allocator's " \
           f"time, not the kernels'): pack device_allocs {6 / n:.1f}, device_frees {2 / n:.1f}, " \
           f"alloc_retries {1 / n:.1f}" in md


def test_whisper_benchmark_adds_the_30s_padded_row(setup, tmp_path):
    """With a Whisper encoder the default modes gain "Whisper padded to 30 s"; its encoder
    computes every utterance at 1500 frames, and the removed share is reported."""
    from helpers.speech import tiny_whisper_dir

    wdir = tiny_whisper_dir(tmp_path / "whisper")
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    rc = cli.main(args(setup, out, "--num_utts", "6", "--repeats", "1", "--batch_size", str(BATCH),
                       "--max_tokens_in_batch", str(MAX_TOKENS), "--pack_tokens", str(PACK), "--profile", "never",
                       "--threads", "1", "--model.encoder.type", "whisper", "--model.encoder.path", wdir,
                       "--data.features", "whisper"))
    torch.set_num_threads(threads)
    assert rc == 0
    res = json.loads((out / "benchmark.json").read_text(encoding="utf-8"))
    m = res["modes"]
    assert list(m) == ["static", "dynamic", "pack", "pack_encoder_padded", "whisper_padded_30s"]
    padded = m["whisper_padded_30s"]
    assert padded["method"] == "Whisper padded to 30 s"
    assert padded["totals"]["enc_sub_frames_computed"] == 6 * 1500
    assert m["pack"]["totals"]["enc_sub_frames_computed"] == m["pack"]["totals"]["enc_sub_frames_real"] < 6 * 1500
    removed = m["pack"]["encoder_compute_removed_vs_30s"]
    assert removed == pytest.approx(1 - m["pack"]["flops"]["fwd_encoder"] / padded["flops"]["fwd_encoder"])
    assert 0.5 < removed < 1   # utterances of a few seconds against a 30 s window
    assert "encoder compute removed by packing the encoder input" in (out / "benchmark.md").read_text(encoding="utf-8")
    conformer = cli.main(args(setup, tmp_path / "c", "--num_utts", "4", "--modes", "static,whisper_padded_30s"))
    assert conformer == 2   # the row needs a Whisper encoder: refused before any work


def test_a_failed_checkpoint_replay_names_the_mode_and_what_ran_before():
    """A mode whose timed pass fails in an activation checkpoint's replay is named, with the modes
    that ran before it in the same process (the 7B pair's failure on a GPU came after another mode)."""
    from west.bench.benchmark import timed_passes
    from west.bench.modes import standard_modes
    from west.train.config import TrainConfig

    class Runner:
        def run(self, batches, warmup_steps):
            if batches == "pack":
                raise torch.utils.checkpoint.CheckpointError("A different number of tensors was saved")
            return {"time_s": 1.0, "cpu_s": 1.0, "util_pct": 50.0, "mean_loss": 1.0}

    modes = standard_modes(["static", "pack"])
    results = {m.name: {} for m in modes}
    with pytest.raises(RuntimeError, match=r"timed pass of pack \(repeat 1\) failed in an activation checkpoint's "
                                           r"replay, after static ran in this process: A different number"):
        timed_passes(Runner(), torch.nn.Module(), modes, {"static": "static", "pack": "pack"}, results,
                     TrainConfig(), torch.device("cpu"), 1, 0, lambda *a: None)
