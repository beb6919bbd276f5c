"""tools/step_summary.py: the steady-state row of a west-train log (medians of the steps after the
warm-up), with rare allocator events averaged so that one step's burst is not hidden."""
import json
import sys

from helpers.e2e import ROOT

sys.path.insert(0, str(ROOT / "tools"))
try:
    import step_summary
finally:
    sys.path.pop(0)


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
