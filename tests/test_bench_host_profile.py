"""west.lab.host_profile: cProfile's figures per step, named by short paths."""
from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest

import west
from west.lab.host_profile import host_table, profile_calls, short_name, top_functions


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _step() -> None:
    for _ in range(3):
        _busy(2.0)
    sorted(range(10))


def test_top_functions_are_per_step_and_ordered_by_own_time():
    steps = 4
    stats, pauses = profile_calls(lambda: [_step() for _ in range(steps)])
    res = top_functions(stats, steps, top=50, gc_pauses=pauses)
    rows = {r["function"].split("(")[-1].rstrip(")"): r for r in res["functions"]}
    assert rows["_busy"]["calls"] == 3 and rows["_step"]["calls"] == 1
    assert rows["_busy"]["total_ms"] >= 6.0 * 0.9                # three 2 ms spins per step
    assert rows["_step"]["total_ms"] >= rows["_busy"]["total_ms"]  # callees included
    own = [r["own_ms"] for r in res["functions"]]
    assert own == sorted(own, reverse=True)
    assert res["profiled_ms_per_step"] >= 6.0 * 0.9
    table = host_table(res)
    assert "| function | calls per step |" in table and "_busy" in table
    assert res["west_by_total"] == []          # this file is not west's: nothing listed, no second table
    assert "west's functions" not in table


def test_west_functions_by_time_with_callees():
    """West's own functions ordered by time including callees: where in the step the host's time goes."""
    import torch

    from west.batch import to_device
    from west.models.projector import group_frames

    def step() -> None:
        for _ in range(5):
            group_frames(torch.randn(7, 4), [3, 4], 2)
        to_device(torch.arange(3), "cpu")

    stats, _ = profile_calls(lambda: [step() for _ in range(2)])
    res = top_functions(stats, 2, top=50)
    names = [r["function"] for r in res["west_by_total"]]
    assert names and all(n.startswith("west/") for n in names)
    assert any("(group_frames)" in n for n in names) and any("(to_device)" in n for n in names)
    totals = [r["total_ms"] for r in res["west_by_total"]]
    assert totals == sorted(totals, reverse=True)
    assert "west's functions by time with callees:" in host_table(res)


def test_short_names():
    assert short_name("/x/lib/python3.12/site-packages/transformers/models/qwen2/modeling_qwen2.py", 7, "forward") \
        == "transformers/models/qwen2/modeling_qwen2.py:7(forward)"
    package = Path(west.__file__).resolve().parent      # where the imported package really is
    assert short_name(str(package / "models" / "conformer.py"), 90, "forward") == "west/models/conformer.py:90(forward)"
    assert short_name(str(package.parent / "tools" / "profile_step.py"), 5, "main") == "tools/profile_step.py:5(main)"
    # another tree's west/ is not the imported package: its whole path, not a name that passes for west's
    assert short_name("/elsewhere/west/models/conformer.py", 90, "forward") \
        == "/elsewhere/west/models/conformer.py:90(forward)"
    assert short_name("~", 0, "<built-in method torch._C._nn.linear>") == "<built-in method torch._C._nn.linear>"


def test_garbage_collections_are_counted_per_step_by_generation():
    def step() -> None:
        gc.collect(0)
        gc.collect(2)

    stats, pauses = profile_calls(lambda: [step() for _ in range(2)])
    res = top_functions(stats, 2, gc_pauses=pauses)
    assert res["gc_per_step"][0]["count"] >= 1 and res["gc_per_step"][2]["count"] >= 1
    assert res["gc_per_step"][2]["ms"] > 0
    assert "generation 2: " in host_table(res)


@pytest.mark.parametrize("checkout", ["west", "speech"])
def test_a_file_in_a_checkout_named_west_is_not_wests_code(tmp_path, checkout):
    """West's code is what lies in the imported package's directory, not any path with a ``west``
    directory in it: a test of a checkout named ``west`` (git clone's default) is not listed as west's."""
    src = tmp_path / checkout / "tests" / "test_mine.py"
    src.parent.mkdir(parents=True)
    src.write_text("def work():\n    return sorted(range(1000))\n")
    namespace: dict = {}
    exec(compile(src.read_text(), str(src), "exec"), namespace)
    stats, _ = profile_calls(lambda: [namespace["work"]() for _ in range(3)])
    res = top_functions(stats, 3, top=50)
    assert res["west_by_total"] == []
    assert f"{src}:1(work)" in [r["function"] for r in res["functions"]]   # named by its whole path
