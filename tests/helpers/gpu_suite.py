"""Run tools/gpu_suite.sh on the CPU with toy sizes, as its tests do, and read what it wrote."""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from helpers.e2e import ROOT, subprocess_env


def run_toy_suite(tmp_path: Path, parts: str, *options: str) -> tuple[Path, str, str]:
    """(OUT, suite.md, suite.log) of ``gpu_suite.sh OUT --tiny --device cpu --parts PARTS [OPTIONS]``
    with OUT = tmp_path/out; fails the test with the logs' tails if the suite failed."""
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_suite.sh"), str(out), "--tiny", "--device", "cpu", "--python",
         sys.executable, "--work_dir", str(tmp_path / "work"), "--parts", parts, *options],
        env=subprocess_env(), capture_output=True, text=True, timeout=900)
    log = (out / "suite.log").read_text(encoding="utf-8") if (out / "suite.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    return out, (out / "suite.md").read_text(encoding="utf-8"), log


def bundled_jsons(out: Path) -> dict:
    """The JSON files the suite packed into OUT/json.tar (past the device tool's 8 files), by name."""
    with tarfile.open(out / "json.tar") as tar:
        return {Path(m.name).name: json.load(tar.extractfile(m)) for m in tar.getmembers() if m.isfile()}
