"""The host-cost-per-operator workloads (west.lab.launch_floor, tools/launch_floor.py): what
each dispatches, and the tool's table and JSON. Times are printed, never asserted."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from west.lab.launch_floor import _workload, count_ops, measure

ROOT = Path(__file__).resolve().parents[1]


def test_bare_workloads_dispatch_one_operator_per_call():
    cpu = torch.device("cpu")
    assert count_ops(_workload("launch", cpu, 300, 16)) == (300, 0)
    assert count_ops(_workload("allocate", cpu, 300, 16)) == (300, 0)


def test_autocast_adds_the_casts_autograd_chain_lacks():
    cpu = torch.device("cpu")
    plain, plain_views = count_ops(_workload("autograd", cpu, 120, 16))
    cast, cast_views = count_ops(_workload("autocast", cpu, 120, 16))
    layers = 120 // 12
    assert plain_views == cast_views > 0
    # per layer the weight's cast forward and its gradient's cast back; once, the input's cast
    # (bf16 from then on) and the output's cast to float32 for the loss with its gradient's
    assert cast - plain == 2 * layers + 3


def test_measure_reports_per_operator_times():
    row = measure("autograd", torch.device("cpu"), ops=60, width=8, repeats=2, warmup=1)
    assert row["operators"] == count_ops(_workload("autograd", torch.device("cpu"), 60, 8))[0]
    assert row["host_us_per_op"] > 0 and row["wall_us_per_op"] >= row["host_us_per_op"]


def test_unknown_workload_is_refused():
    with pytest.raises(ValueError, match="workload must be one of"):
        _workload("nope", torch.device("cpu"), 10, 8)


def test_tool_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "floor.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools/launch_floor.py"), "--device", "cpu", "--ops", "60",
                          "--width", "8", "--repeats", "1", "--step_ops", "1000", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert res.returncode == 0, res.stderr
    assert "| autocast |" in res.stdout and "a host-paced step of 1,000 operators" in res.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["workload"] for r in rows] == ["launch", "allocate", "autograd", "autocast"]
