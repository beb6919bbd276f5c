"""tools/gpu_suite.sh runs end to end, so a lent GPU's minutes go to measuring, not debugging:
the same steps with toy sizes on the CPU. Here its west-train parts (the real loader) and its own
options; its benchmark and profiler parts in test_tools_gpu_suite_bench.py."""
import re
import subprocess
import tarfile
from pathlib import Path

from helpers.e2e import ROOT
from helpers.gpu_suite import bundled_jsons, run_toy_suite


def test_gpu_suite_runs_its_west_train_parts_on_the_cpu_with_toy_sizes(tmp_path):
    """The parts that run west-train and those that read its runs (headroom, configured, encoder_time);
    the benchmark's and the profilers' parts are in test_tools_gpu_suite_bench.py (two files: CI's two
    workers run them side by side)."""
    out, suite, log = run_toy_suite(tmp_path, "build,train,headroom,weights,rotary,qkv,norm,cudnn,gap,ring,encoder_graphs,"
                                              "encoder_graphs_full,encoder_graphs_exact,contention,configured,cuts,"
                                              "late_readback,encoder_time,lora,pyspy_train,syncs_train,optimes_train,preloaded,gil,"
                                              "prefix")
    assert "| train_eager |" in suite
    assert "| train_two_workers |" in suite and "| train_one_thread |" in suite   # contention
    assert "| train_pin_thread |" in suite and "| train_no_pin_thread |" in suite   # gap: the loader
    assert "| train_ring_no_pin_thread |" in suite and "outside the phases and the loader's wait: " in suite
    assert "train_ring_no_pin_thread, phase by phase (train.phase_marks)" in suite
    assert "| train_stock_norm |" in suite                              # norm: the stock RMSNorms
    assert "| train_bf16_weights |" in suite                            # weights: bf16 working copies
    assert "| train_fused_rotary |" in suite                            # rotary: one autograd node
    assert "| train_fused_qkv |" in suite                               # qkv: one stacked product per attention
    assert "| train_prompt_whole |" in suite and "| train_prompt_shared |" in suite   # prefix: once per row
    assert "| train_pinned_ring |" in suite and "ring: check_pinned_ring.py skipped (needs CUDA" in log   # ring
    assert "train_pinned_ring, phase by phase (train.phase_marks)" in suite
    assert "| train_encoder_graphs |" in suite and "train_encoder_graphs, phase by phase" in suite   # encoder_graphs
    # the replay's rows: the largest planned pack's encoder frames in multiples of 512, under pack x stride (2048)
    replay_rows = re.search(r"\n- 3 encoder batches padded \(eager\) at (\d+) rows \(\d+ % of them real\), 0 unpadded "
                            r"\(train.encoder_graphs\)", suite)
    assert replay_rows and int(replay_rows[1]) % 512 == 0 and int(replay_rows[1]) < 2048, suite
    shape = re.search(rf"the encoder's blocks replay at {int(replay_rows[1]):,} rows per pack in (\d+) segments of at "
                      r"most ([\d,]+) frames \(rows: the largest planned pack holds", log)
    assert shape, log[-3000:]
    assert "| train_encoder_graphs_no_ckpt |" in suite                   # encoder_graphs_full
    assert "| train_nodrop_graphs |" in suite and "[compare_losses] 3 steps: largest relative" in suite   # _exact
    assert "| train_readback |" in suite and "| train_late_readback |" in suite   # late_readback
    assert "| train_lora |" in suite and "llm (LoRA) 0.06 M" in log   # lora: the adapters train
    assert "pyspy_train: skipped (no py-spy" in log or "`Projector.forward`: " in suite   # west-train sampled
    assert "syncs_train: skipped (torch's sync debug mode needs CUDA)" in log
    # optimes_train and gil: west-train's host time by operator in a few phases, and the launching thread's split
    assert "| train_op_times |" in suite and "| train_op_times_fixed_segments |" in suite   # expandable segments off
    assert "| train_op_times_no_nvml |" in suite                                          # no NVML sampler thread
    assert suite.count("**projector**: ") == 5 and "the timer's own (means)" in suite
    assert suite.count("the launching thread, means per step: ") == 5 * 4   # the thread lines, a phase each
    # preloaded: the same loop on the loader's first batches from memory, the loader's worker process ended
    assert "| train_op_times_preloaded |" in suite
    assert "(the loop without its loader: preloaded 3 batches from the loader, then ended it: 0 child processes" in suite
    assert "(Python's switch interval: 0.5 ms)" in suite and "| train_op_times_gil |" in suite   # gil (runs on --tiny)
    assert "| train_static |" in suite and "| train_static_cudnn |" in suite   # cudnn: static batches, SDPA off/on
    assert "| host launch s | sync wait s | device allocs | alloc retries |" in suite
    kernels = suite.split("### Attention kernels the runs chose (suite.log)\n\n")[1].split("\n\n")[0]
    assert "- packed attention on cpu/float32: sdpa_segments (cpu)" in kernels.splitlines()
    # encoder_time (no replay on the CPU) at west-train's shape, and in the fixed slots and bound for comparison
    assert (f"### The encoder's 2 blocks on CPU: {int(replay_rows[1]):,} rows in {shape[1]} segments of at most "
            f"{shape[2]}, 400 real") in suite
    assert "| eager in 64 segments of at most 256 |" in suite
    assert "| eager, padded to the static shape |" in suite and "operators moving" in suite
    assert "x the benchmark's" in suite                                  # headroom: west-train vs the benchmark
    assert suite.count("x the benchmark's") == 2 and "- benchmark, pack token 1024, encoder packed" in suite   # configured
    assert "configured: west-train as configured first" in log   # before part late_readback, as `open` orders them
    assert (f"configured: the encoder replayed at west-train's {int(replay_rows[1])} rows in {shape[1]} segments of "
            f"at most {shape[2].replace(',', '')}") in log   # the same replayed shape
    headroom = (out / "benchmark_headroom.md").read_text(encoding="utf-8")
    assert "| sequence pack |" in headroom and "MFU" in headroom
    # more than 8 files: past the device tool's limit the JSON files travel in json.tar
    assert sorted(p.name for p in out.iterdir()) == ["benchmark_headroom.md", "json.tar", "suite.log", "suite.md"]
    jsons = bundled_jsons(out)
    assert sorted(set(jsons) - {"pyspy_train.json"}) == [   # pyspy_train's where py-spy is installed
        "attention_prefix.json", "cuts_exact.json", "encoder_time.json", "graphs_exact.json", "late_exact.json",
        "op_times_train_op_times.json",
        "op_times_train_op_times_fixed_segments.json", "op_times_train_op_times_gil.json",
        "op_times_train_op_times_no_nvml.json", "op_times_train_op_times_preloaded.json"]
    assert jsons["graphs_exact.json"]["worst"]["rel"] < 1e-5   # padded blocks run eagerly on the CPU
    assert jsons["late_exact.json"]["worst"]["rel"] == 0       # the same steps, read a step late
    assert jsons["cuts_exact.json"]["worst"]["rel"] < 1e-2      # cuts: at most the stacked q/k/v product's rounding
    assert "| train_llm_cuts |" in suite
    assert all(jsons[f"op_times_{n}.json"]["train_rc"] == 0 and jsons[f"op_times_{n}.json"]["phases"]
               for n in ("train_op_times", "train_op_times_fixed_segments", "train_op_times_no_nvml",
                         "train_op_times_gil", "train_op_times_preloaded"))
    assert jsons["op_times_train_op_times_preloaded.json"]["preload"].startswith("preloaded 3 batches")
    assert jsons["op_times_train_op_times_gil.json"]["switch_interval_ms"] == 0.5
    prefix_rows = {r["backend"]: r for r in jsons["attention_prefix.json"]["rows"]}   # prefix: the CPU's route
    assert [c["shared_prefix"] for c in prefix_rows["sdpa_segments"]["checks"]] == [14]
    assert prefix_rows["sdpa_segments"]["worst"] < 1e-5 and "A shared prompt prefix: the kernels" in suite


def test_parts_past_the_budget_are_skipped_and_said(tmp_path):
    """--budget: a part whose H100 estimate would end past it is logged as skipped, not started,
    so a device call ends cleanly before its limit with what it finished."""
    _, _, log = run_toy_suite(tmp_path, "attention,train", "--budget", "30")
    assert "attention skipped: about 90 s on an H100" in log and "train skipped" in log
    assert "skipped: attention train" in log.splitlines()[-1]


def test_kernels_part_needs_cuda_and_more_than_eight_files_are_bundled(tmp_path):
    """The device tool returns at most 8 files from OUT: past that the suite packs its JSON files
    into json.tar. The kernels-only trace part says it needs CUDA and skips on the CPU."""
    out = tmp_path / "out"
    out.mkdir()
    for i in range(9):
        (out / f"part{i}.json").write_text("{}", encoding="utf-8")
    _, _, log = run_toy_suite(tmp_path, "kernels")
    assert "kernels: skipped (a kernels-only trace needs CUDA)" in log
    assert "more than 8 files: the JSON files are in json.tar" in log
    assert sorted(p.name for p in out.iterdir()) == ["json.tar", "suite.log", "suite.md"]
    with tarfile.open(out / "json.tar") as tar:
        assert sorted(Path(n).name for n in tar.getnames()) == [f"part{i}.json" for i in range(9)]


def test_every_part_is_defined_estimated_and_listed():
    """A part the order of `--parts open` names has a function (in gpu_suite.sh or tools/gpu_suite/*_parts.sh)
    and a time estimate (what --budget skips by); every defined part is in that order, or is one of the
    second call's parts (big, encoder_graphs_full); the default parts are issue 23's item 5 (the seed's
    table, the kernels' check, a short west-train); docs/benchmarks.md's table of parts has a row for each."""

    tools = ROOT / "tools"
    text = "\n".join(p.read_text(encoding="utf-8") for p in [tools / "gpu_suite.sh", *sorted((tools / "gpu_suite").glob("*_parts.sh"))])
    defined = set(re.findall(r"^part_(\w+)\(\) \{", text, re.M))
    every = re.search(r"^open_parts=([\w,]+)", text, re.M).group(1).split(",")
    estimated = set(re.findall(r"\[(\w+)\]=\d+", re.search(r"declare -A estimate=\(([^)]*)\)", text).group(1)))
    assert len(every) == len(set(every)) and set(every) <= defined
    assert defined - set(every) == {"big", "big_bench", "train_again", "encoder_graphs_full"}
    assert re.search(r"^seed_parts=([\w,]+)", text, re.M).group(1) == "build,bench,attention,train"
    assert re.search(r"^parts=(\S+)", text, re.M).group(1) == "$seed_parts"
    assert estimated == defined
    rows = set(re.findall(r"^\| (\w+) \|", (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"), re.M))
    assert defined <= rows, f"parts without a row in docs/benchmarks.md's table: {sorted(defined - rows)}"


def test_plan_says_what_a_call_would_run_and_runs_nothing(tmp_path):
    """--plan: each part in order with its estimate, skipped as --budget would skip it (a later, shorter
    part may still fit), the total; no part runs and no work dir is made."""
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_suite.sh"), str(tmp_path / "out"), "--plan", "--parts", "build,bench,train",
         "--budget", "150", "--work_dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["build: about 50 s, ends at about 50 s", "bench: about 430 s, skipped (100 s left)",
                                        "train: about 40 s, ends at about 90 s", "about 90 s by the estimates (--budget 150)"]
    assert not (tmp_path / "work").exists() and not (tmp_path / "out" / "suite.log").exists()
    plan = subprocess.run(["bash", str(ROOT / "tools" / "gpu_suite.sh"), str(tmp_path / "out"), "--plan"],
                          capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert [line.split(":")[0] for line in plan[:-1]] == ["build", "bench", "attention", "train"]   # the default
    plan = subprocess.run(["bash", str(ROOT / "tools" / "gpu_suite.sh"), str(tmp_path / "out"), "--plan", "--parts",
                           "open"], capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert [line.split(":")[0] for line in plan[:3]] == ["build", "optimes_train", "preloaded"] and len(plan) > 40
