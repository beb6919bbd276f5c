"""examples/hf_trainer_packing.py runs as a user would run it (small sizes) and prints its table."""
from __future__ import annotations

import subprocess

import pytest

from helpers.e2e import PYTHON, ROOT, subprocess_env


@pytest.mark.parametrize("trainer", ["trainer", "sft"])
def test_example_runs_and_reports_both_layouts(tmp_path, trainer):
    if trainer == "sft":
        pytest.importorskip("trl")
    out = subprocess.run([PYTHON, str(ROOT / "examples" / "hf_trainer_packing.py"), "--samples", "48",
                          "--trainer", trainer, "--out", str(tmp_path)],
                         capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    padded = next(line for line in lines if line.startswith("padded "))
    packed = next(line for line in lines if line.startswith("packed "))
    assert float(padded.split()[3].rstrip("%")) > 0 and packed.split()[3] == "0.0%"
    assert any(line.strip().startswith("256 ") for line in lines)   # the when-packing-helps table
