"""tools/gpu_suite.sh's benchmark and profiler parts end to end on the CPU with toy sizes: the seed's
table under a memory budget, the attention checks, the profiles, phase marks and operator timings of
the benchmark's runner (its west-train parts: test_tools_gpu_suite.py)."""
import re

from helpers.gpu_suite import bundled_jsons, run_toy_suite


def test_gpu_suite_runs_its_benchmark_and_profiler_parts_on_the_cpu_with_toy_sizes(tmp_path):
    out, suite, log = run_toy_suite(tmp_path, "build,attention,bench,marks,pyspy,graphs,profile,hostpy,floor,queues,"
                                              "best,best_sizes,swiglu,loss,roofline,optimes")
    assert "time on training 10,000 utts (extrapolated from" in suite   # bench: the seed's table
    assert "### pack (" in suite and "| forward/llm |" in suite          # the profile's tables
    assert "| autocast |" in suite and "[launch_floor] cpu:" in suite     # floor: host time per operator
    assert "Python on the launching thread" in suite and "| `<method 'run_backward'" in suite   # hostpy
    # marks: 3 modes, the cuts; queues twice; hostpy_graphs; optimes 2; pyspy's marked steps where py-spy is installed
    spied = "samples in 12 steps at 20 Hz" in suite
    assert suite.count("unprofiled, marked at phase boundaries") == 9 + spied
    assert "| train_queues |" in suite and "train_queues, phase by phase" in suite   # queues: a deeper launch queue
    assert "| train_marks |" in suite and "train_marks, phase by phase (train.phase_marks)" in suite   # west-train marked
    for size in (2048, 3072):   # best_sizes: part best at 2x and 3x the pack, its tables in suite.md only
        section = suite.split(f"part best at pack {size}\n\n", 1)[1].split("\n#", 1)[0]
        assert section.startswith("| method | configuration |")
        assert f"| sequence pack | pack token {size}, encoder packed |" in section
        assert "host ms per step, queueing forward+backward+clip" in section
    assert "| train_fused_swiglu |" in suite and "(part best, without:) | sequence pack |" in suite   # swiglu
    assert "- dynamo recompilations in best_swiglu's benchmark (TORCH_LOGS=recompiles): " in suite
    assert "| **whole step** |" in suite and "MFU at most" in suite   # roofline (its kernels: CUDA's)
    assert "### A frozen SwiGLU MLP on CPU: 256 rows" in suite and "| recomputed and fused |" in suite
    # pyspy: without py-spy on the machine (CI) the part says so and the suite goes on
    assert "pyspy: skipped (no py-spy" in log or "samples in 12 steps at 20 Hz" in suite
    # optimes: the benchmark's host time by operator in a few phases, with the launching thread's split
    assert suite.count("**projector**: ") == 2 and "unprofiled, the host's time by operator)" in suite
    phase_lines = [ln for ln in suite.splitlines() if ln.startswith("the launching thread, means per step: ")]
    assert len(phase_lines) == 2 * 4
    assert all("; taken by the machine: the hypervisor's steal (all CPUs) " in ln for ln in phase_lines)
    # the host's figures per step (west.host_clock): west-train's runs and the benchmark's timed passes
    assert "the host's ms per step (means): the launching thread " in suite
    assert "- the host's ms per timed step (west/host_clock.py; " in suite
    # around every part: what the hypervisor and the cgroup took from the machine meanwhile (west.host_clock)
    assert "[gpu_suite] since boot: " in log and re.search(r"\] bench, the machine meanwhile: (no CPU quota|a CPU quota "
                                                           r"of [\d.]+ cores), \d+ CPUs; steal [\d.]+ CPU-s", log)
    assert "### the LLM's loss alone, H 32, V 1,000" in suite and "| 64 | bf16 | frozen | chunked |" in suite   # loss
    assert "| train_graphs |" in suite and "LLM rows padded (eager) at 1024 tokens, 0 unpadded (train.cuda_graphs)" in suite
    assert "train.cuda_graphs true:" in suite   # the benchmark with it (without: the same command, on a GPU only)
    assert "LLM rows padded (eager) at 1024 tokens, 0 unpadded\n" in suite
    # more than 8 files: past the device tool's limit the JSON files travel in json.tar
    assert sorted(p.name for p in out.iterdir()) == ["benchmark.md", "benchmark_best.md", "benchmark_best_swiglu.md",
                                                     "json.tar", "suite.log", "suite.md"]
    best = (out / "benchmark_best.md").read_text(encoding="utf-8")   # best: encoder replayed, no LLM checkpointing
    best_rows = re.search(r"pack: 3 encoder batches padded \(eager\) at (\d+) rows \(\d+ % of them real\), 0 unpadded",
                          best)
    assert "| sequence pack |" in best and best_rows and int(best_rows[1]) % 512 == 0 and int(best_rows[1]) < 2048
    jsons = bundled_jsons(out)
    assert sorted(set(jsons) - {"pyspy.json", "pyspy_marks.json"}) == [   # where py-spy is installed
        "attention.json", "benchmark.json", "encoder_attention.json", "floor.json", "hostpy.json", "hostpy_graphs.json",
        "loss.json", "marks.json", "marks_cuts.json", "marks_queues.json", "marks_queues_off.json", "op_times.json",
        "profile.json", "roofline.json", "swiglu.json"]
    bench = jsons["benchmark.json"]
    assert {"static", "dynamic", "pack", "pack_encoder_padded"} <= set(bench["modes"])
    assert all(r["ops"]["per_step"]["total"] > 0 for r in bench["modes"].values())
    rows = jsons["encoder_attention.json"]["rows"]
    assert rows and not any("error" in r for r in rows)
    assert max(r["worst"] for r in rows) < 1e-4            # float32 on the CPU
    marks = jsons["marks.json"]["modes"]
    assert set(marks) == {"pack", "pack_encoder_padded", "static"}
    assert all(r["phase_marks"]["steps"] == 6 and r["phase_marks"]["step_ms"] > 0 for r in marks.values())
    assert "phase_marks" in jsons["hostpy_graphs.json"]["modes"]["pack"]
    assert set(jsons["op_times.json"]["modes"]) == {"pack", "pack_encoder_padded"}
    assert all({"phase_marks", "op_times"} <= set(r) for r in jsons["op_times.json"]["modes"].values())
    host = jsons["hostpy.json"]["modes"]["pack"]
    assert host["profiled_ms_per_step"] > 0 and host["functions"][0]["own_ms"] >= host["functions"][-1]["own_ms"]
