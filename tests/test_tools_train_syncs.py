"""tools/train_syncs.py: west-train's host synchronisations by line, checked on the CPU with a
stand-in for west-train that warns as torch's sync debug mode does (the mode needs a GPU)."""
from __future__ import annotations

import warnings

import pytest
import torch

from helpers.e2e import import_tool


def test_a_run_is_counted_by_line_with_its_exit_code_and_tabled_per_step():
    tool = import_tool("train_syncs")
    modes, seen_argv = [], []

    def fake_train(argv):
        seen_argv.append(argv)
        for _ in range(4):
            warnings.warn("called a synchronizing CUDA operation", UserWarning)   # the projector's, say
        warnings.warn("called a synchronizing CUDA operation", UserWarning)       # another line
        return 3

    rc, found = tool.counted_run(fake_train, ["--max_steps", "2"], modes.append)
    assert rc == 3 and seen_argv == [["--max_steps", "2"]] and modes == [1, 0]
    assert sorted(found.values()) == [1, 4] and all(p.startswith("tests/test_tools_train_syncs.py:") for p in found)
    text = tool.table(found, steps=2)
    assert text.startswith("host synchronisations in west-train: 5 over 2 steps (2.5 per step")
    top = found.most_common(1)[0][0]
    assert f"| `{top}` | 4 | 2.0 |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so():
    tool = import_tool("train_syncs")
    assert tool.main(["--steps", "2", "--", "--config", "x.yaml"]) == 2
