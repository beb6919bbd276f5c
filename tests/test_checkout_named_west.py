"""The tests that read code paths, run from a checkout whose directory is named ``west``.

``git clone`` names the checkout ``west``, so every file of it (tests, tools, recipes) has ``/west/`` in
its path: code that told west's own files by such a fragment counted them all as west's. CI's checkout
has another name, so this test copies what those tests need into a directory named ``west`` and runs
them there, in a child pytest that imports west from that copy.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Tests whose results name code by its path: which functions or lines are west's, which are the checkout's.
PATH_TESTS = (
    "tests/test_bench_host_profile.py",
    "tests/test_bench_op_times.py::test_a_real_step_is_timed_in_its_watched_phases_by_line_and_leaves_nothing_behind",
    "tests/test_bench_op_times.py::test_a_slow_operator_and_slow_python_are_told_apart",
    "tests/test_tools_count_syncs.py::test_counts_sync_warnings_by_their_line_and_passes_others_on",
)
# What they import or read: the package, the tests' helpers, the tools they load, the tiny model's config.
NEEDED = ("west", "tools", "tests/helpers", "tests/conftest.py", "recipes/aishell/conf/tiny_cpu.yaml")


def test_path_reading_tests_pass_in_a_checkout_named_west(tmp_path):
    checkout = tmp_path / "west"
    skip = shutil.ignore_patterns("__pycache__")
    for rel in NEEDED + tuple(sorted({t.split("::")[0] for t in PATH_TESTS})):
        src, dst = ROOT / rel, checkout / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst, ignore=skip) if src.is_dir() else shutil.copy2(src, dst)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    # `python -m` puts the working directory first on sys.path: west is imported from the copy,
    # ahead of the editable install's finder
    where = subprocess.run([sys.executable, "-c", "import west; print(west.__file__)"], cwd=checkout, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).resolve() == (checkout / "west" / "__init__.py").resolve()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PATH_TESTS],
                         cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout
