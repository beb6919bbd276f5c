"""tools/step_summary.py: the steady-state row of a west-train log (medians of the steps after the
warm-up), with rare allocator events averaged so that one step's burst is not hidden."""
import json
import subprocess
import sys

from helpers.e2e import ROOT, import_tool, subprocess_env

step_summary = import_tool("step_summary")


def test_medians_after_the_warm_up_and_mean_allocator_events(tmp_path, capsys):
    log = tmp_path / "train_log.jsonl"
    steps = [dict(step=i + 1, status="ok", step_time_s=t, peak_mem_mb=1024.0 * (i + 1), device_allocs=a,
                  alloc_retries=0, peak_reserved_mb=r) for i, (t, a, r) in enumerate(
                      [(9.0, 500, 9000.0), (0.3, 0, 5120.0), (0.5, 0, 6144.0), (0.4, 9, 5632.0)])]
    lines = [json.dumps(s) for s in steps] + [json.dumps({"event": "eval", "step": 4, "loss": 1.0})]
    log.write_text("\n".join(lines) + "\n", encoding="utf-8")
    s = step_summary.summarize(log, skip=1)
    assert s["steps"] == 3 and s["step_time_s"] == 0.4            # median of the last three
    assert s["device_allocs"] == 3.0 and s["alloc_retries"] == 0   # mean: one step's 9 is not lost
    assert s["peak_mem_mb"] == 4.0 and s["gpu_busy_pct"] is None   # max, in GiB; never sampled: none
    assert s["peak_reserved_mb"] == 6.0                            # the most after the warm-up, in GiB
    assert step_summary.main([str(log), "--name", "r", "--skip", "1"]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| r | 3 | 0.400 |") and row.endswith("| 4.0 | 6.0 | – | – | 3.0 | 0.0 |")


def test_time_outside_the_marked_phases_is_taken_step_by_step(tmp_path, capsys):
    """Medians of the step and of its phases do not subtract: a step whose loader waited long and
    one whose phases ran long must each leave only the loop's own work outside."""
    def step(i, wall, data, phase_ms):
        phases = [{"phase": name, "host_ms": ms, "gpu_ms": ms, "lag_start_ms": 0.0, "lag_end_ms": 0.0}
                  for name, ms in zip(("encoder forward", "LLM forward"), phase_ms)]
        return dict(step=i, status="ok", step_time_s=wall, data_wait_s=data,
                    phase_marks={"gpu": True, "phases": phases})
    log = tmp_path / "train_log.jsonl"
    steps = [step(1, 0.300, 0.100, (100.0, 90.0)), step(2, 0.300, 0.000, (150.0, 140.0)),
             step(3, 0.250, 0.010, (120.0, 100.0))]
    log.write_text("\n".join(json.dumps(s) for s in steps) + "\n", encoding="utf-8")
    s = step_summary.summarize(log, skip=0)
    assert abs(s["outside_ms"] - 10.0) < 1e-9   # 10, 10, 20 ms outside: median 10
    assert step_summary.main([str(log), "--skip", "0"]) == 0
    assert "outside the phases and the loader's wait: 10.0 ms per step" in capsys.readouterr().out


def test_the_time_the_machine_took_is_a_line_of_means(tmp_path, capsys):
    """The host's figures as a line of means per step (steal and throttling come in bursts: a throttled
    period is 100 ms, which a median would hide)."""
    log = tmp_path / "train_log.jsonl"
    steps = [dict(step=i + 1, status="ok", step_time_s=0.3, steal_ms=s, throttled_ms=t, host_cpu_ms=c,
                  host_kernel_ms=2.0, host_runqueue_ms=0.5, host_faults=10, host_switches=4, autograd_cpu_ms=40.0)
             for i, (s, t, c) in enumerate([(0.0, 0.0, 100.0), (3.0, 0.0, 110.0), (0.0, 90.0, 120.0)])]
    log.write_text("\n".join(json.dumps(s) for s in steps) + "\n", encoding="utf-8")
    assert step_summary.main([str(log), "--skip", "0"]) == 0
    assert ("the host's ms per step (means): the launching thread 110.0 on a core (2.0 in the kernel, 10 page "
            "faults, 4 times blocked), 0.5 waiting for one; autograd's threads 40.0 on a core; taken by the machine: the hypervisor's "
            "steal (all CPUs) 1.0, the cgroup's throttling 30.0; the launching thread blocked otherwise: 149.5") \
        in capsys.readouterr().out   # 300 ms a step, 110 on a core, 0.5 waiting for one, 40 waiting for autograd



def test_it_runs_without_importing_torch(tmp_path):
    """gpu_suite.sh runs it after every west-train run (about 40 a call): importing torch cost seconds each."""
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps(dict(step=i, status="ok", step_time_s=0.5)) + "\n" for i in (1, 2, 3)),
                   encoding="utf-8")
    tool = ROOT / "tools" / "step_summary.py"
    probe = (f"import runpy, sys; sys.argv = ['step_summary', {str(log)!r}, '--name', 'r', '--skip', '1']\n"
             f"try:\n    runpy.run_path({str(tool)!r}, run_name='__main__')\nexcept SystemExit as e:\n"
             "    assert not e.code, e.code\n"
             "print('torch imported' if 'torch' in sys.modules else 'torch not imported')")
    out = subprocess.run([sys.executable, "-c", probe], env=subprocess_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "torch not imported" and lines[-2].startswith("| r | 2 | 0.500 |")
