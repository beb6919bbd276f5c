"""tools/gpu_suite.sh runs end to end, so a lent GPU's minutes go to measuring, not debugging:
every part with toy sizes on the CPU (one shared build), and the script's own options."""
import re
import subprocess
import tarfile
from pathlib import Path

from helpers.e2e import ROOT
from helpers.gpu_suite import bundled_jsons, run_toy_suite

SUITE = ROOT / "tools" / "gpu_suite.sh"


def test_every_part_runs_on_the_cpu_with_toy_sizes(tmp_path):
    """`--parts all`: the seed's table, the kernels' check, west-train as configured and each A/B run
    behind a key the configs set, the benchmark against west-train, the 7B pair's timed comparison
    (toy shapes), with one build. compile is left out here: inductor on a 2-core CPU takes minutes."""
    parts = re.search(r"^all_parts=([\w,]+)", SUITE.read_text(encoding="utf-8"), re.M).group(1).split(",")
    out, suite, log = run_toy_suite(tmp_path, ",".join(p for p in parts if p != "compile"))
    assert "time on training 10,000 utts (extrapolated from" in suite   # bench: the seed's table
    for run in ("train_configured", "train_configured_again", "train_encoder_eager", "train_readback",
                "train_scope_layer", "train_stock_norm", "train_nodrop_eager", "train_nodrop_graphs", "train_lora",
                "train_prompt_whole", "train_prompt_shared", "train_op_times", "train_op_times_preloaded", "train_op_times_switch"):
        assert f"| {run} |" in suite, run
    assert "#### with the loader" in suite and "#### the loop alone" in suite and "**projector**" in suite  # host_wait
    assert "x the benchmark's" in suite and "- benchmark, pack token 1024, encoder packed" in suite   # configured
    assert "| sequence pack |" in (out / "benchmark_best.md").read_text(encoding="utf-8")            # best
    big = (out / "benchmark_big.md").read_text(encoding="utf-8")                                      # big_bench
    assert "| sequence pack |" in big and "padded to 30 s" in big
    released = (out / "benchmark_released.md").read_text(encoding="utf-8")   # qwen2_audio, qwen3_asr, qwen2_5_omni
    tables = re.split(r"^## (\w+) \(tiny shape\)$", released, flags=re.M)[1:]
    assert tables[::2] == ["qwen2_audio", "qwen3_asr", "qwen2_5_omni"]
    assert "padded to 30 s" in tables[1] and all("| sequence pack |" in t for t in tables[1::2])
    assert all("| static batch |" in t for t in tables[3::2])
    assert "### Attention kernels the runs chose (suite.log)" in suite
    assert "FAILED" not in log and "skipped" not in log.splitlines()[-1]
    jsons = {p.name for p in out.glob("*.json")} or set(bundled_jsons(out))
    assert {"attention.json", "encoder_attention.json", "graphs_exact.json", "late_exact.json",
            "attention_prefix.json", "benchmark.json"} <= jsons
    exact = bundled_jsons(out) if (out / "json.tar").exists() else {}
    if exact:
        assert exact["graphs_exact.json"]["worst"]["rel"] < 1e-5   # padded blocks run eagerly on the CPU
        assert exact["late_exact.json"]["worst"]["rel"] == 0       # the same steps, read a step late


def test_parts_past_the_budget_are_skipped_and_said(tmp_path):
    """--budget: a part whose estimate would end past it is logged as skipped, not started, so a
    call ends cleanly before its limit with what it finished."""
    _, _, log = run_toy_suite(tmp_path, "attention,train", "--budget", "30")
    assert "attention skipped: about 90 s by its estimate" in log and "train skipped" in log
    assert "skipped: attention train" in log.splitlines()[-1]


def test_more_than_eight_files_are_bundled(tmp_path):
    """OUT keeps at most 8 files (what a time-limited device call returns): past that the suite packs
    its JSON files into json.tar."""
    out = tmp_path / "out"
    out.mkdir()
    for i in range(9):
        (out / f"part{i}.json").write_text("{}", encoding="utf-8")
    _, _, log = run_toy_suite(tmp_path, "train_again", "--budget", "1")
    assert "more than 8 files: the JSON files are in json.tar" in log
    assert sorted(p.name for p in out.iterdir()) == ["json.tar", "suite.log", "suite.md"]
    with tarfile.open(out / "json.tar") as tar:
        assert sorted(Path(n).name for n in tar.getnames()) == [f"part{i}.json" for i in range(9)]


def test_every_part_is_defined_estimated_and_documented():
    """Each part `all` names has a function and a time estimate (what --budget skips by); every defined
    part is in `all` or is big (the 7B pair with its west-train run); the default is the seed's four;
    docs/benchmarks.md's table of parts has a row for each."""
    tools = ROOT / "tools"
    text = "\n".join(p.read_text(encoding="utf-8") for p in [SUITE, *sorted((tools / "gpu_suite").glob("*_parts.sh"))])
    defined = set(re.findall(r"^part_(\w+)\(\) \{", text, re.M))
    every = re.search(r"^all_parts=([\w,]+)", text, re.M).group(1).split(",")
    estimated = set(re.findall(r"\[(\w+)\]=\d+", re.search(r"declare -A estimate=\(([^)]*)\)", text).group(1)))
    assert len(every) == len(set(every)) and set(every) <= defined
    assert defined - set(every) == {"big"}
    assert re.search(r"^seed_parts=([\w,]+)", text, re.M).group(1) == "build,bench,attention,train"
    assert estimated == defined
    rows = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"), re.M))
    assert defined <= rows, f"parts without a row in docs/benchmarks.md's table: {sorted(defined - rows)}"


def test_plan_says_what_a_call_would_run_and_runs_nothing(tmp_path):
    """--plan: each part in order with its estimate, skipped as --budget would skip it (a later, shorter
    part may still fit), the total; no part runs and no work dir is made."""
    proc = subprocess.run(["bash", str(SUITE), str(tmp_path / "out"), "--plan", "--parts", "build,bench,train",
                           "--budget", "150", "--work_dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["build: about 50 s, ends at about 50 s", "bench: about 200 s, skipped (100 s left)",
                                        "train: about 40 s, ends at about 90 s", "about 90 s by the estimates (--budget 150)"]
    assert not (tmp_path / "work").exists() and not (tmp_path / "out" / "suite.log").exists()
    plan = subprocess.run(["bash", str(SUITE), str(tmp_path / "out"), "--plan"],
                          capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert [line.split(":")[0] for line in plan[:-1]] == ["build", "bench", "attention", "train"]   # the default
    bad = subprocess.run(["bash", str(SUITE), str(tmp_path / "out"), "--frobnicate"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unknown option --frobnicate" in bad.stderr
