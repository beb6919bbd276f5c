"""tools/count_syncs.py: the CUDA sync counter's bookkeeping, checked on the CPU with warnings
shaped like torch's sync debug mode ones (the mode itself needs a GPU: tools/gpu_suite.sh)."""
from __future__ import annotations

import warnings

from helpers.e2e import import_tool


def _tool():
    count_syncs = import_tool("count_syncs")
    return count_syncs


def test_counts_sync_warnings_by_their_line_and_passes_others_on():
    tool = _tool()
    modes = []

    def step():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning)   # the line counted
        warnings.warn("something else", DeprecationWarning)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = tool.count_syncs(step, modes.append)
    assert modes == [1, 0]                                   # debug mode on for the call, then off
    assert sum(found.values()) == 3 and len(found) == 1
    (place,) = found
    assert place.startswith("tests/test_tools_count_syncs.py:") and "(step)" in place
    assert [str(w.message) for w in seen] == ["something else"]


def test_debug_mode_is_switched_off_when_the_step_fails():
    tool = _tool()
    modes = []

    def boom():
        raise RuntimeError("out of memory")

    try:
        tool.count_syncs(boom, modes.append)
    except RuntimeError:
        pass
    assert modes == [1, 0]


def test_every_mode_counts_its_steps_after_a_warm_up(tmp_path, corpus, monkeypatch):
    """The per-mode loop on the CPU: a stand-in for the step's one read warns once per step."""
    import argparse

    from west.lab.tool_setup import tool_setup

    from helpers.e2e import bench_setup

    tool = _tool()
    llm, conf = bench_setup(tmp_path, corpus["texts"].values())
    args = argparse.Namespace(config=str(conf), data=str(corpus["list"]), num_utts=len(corpus["texts"]),
                              modes="static,pack", batch_size=4, max_tokens_in_batch=512, pack_tokens=1024, seed=0)
    setup = tool_setup(args, ["--model.llm.path", str(llm)], tmp_path / "subset.list")
    runner = setup.runner
    real, calls = runner.step, []

    def step(b, opt, sched):
        calls.append(b)
        out = real(b, opt, sched)
        warnings.warn("called a synchronizing CUDA operation", UserWarning)   # the read at a step's end
        return out

    monkeypatch.setattr(runner, "step", step)
    rows = tool.per_mode(setup, 2, lambda mode: None)
    assert set(rows) == {"static", "pack"}
    assert rows["static"]["steps"] == 2                       # at most 2 counted steps per mode
    for r in rows.values():
        assert r["steps"] >= 1 and r["per_step"] == [1] * r["steps"] and r["median"] == 1
        (place,) = r["where"]
        assert "tests/test_tools_count_syncs.py" in place and r["where"][place] == r["steps"]
    assert len(calls) == sum(r["steps"] + 1 for r in rows.values())   # a warm-up step per mode, uncounted
