"""tools/check_pinned_ring.py's own code on the CPU (the GPU's parts replaced by stand-ins), so a
lent GPU's minutes go to its figures; the ring itself is tested in test_pinned_ring.py."""
import sys

import pytest
import torch

from helpers.e2e import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import check_pinned_ring as tool  # noqa: E402


class DoneEvent:
    def record(self):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


@pytest.fixture
def cpu_stand_ins(monkeypatch):
    ring_class = tool.PinnedRing

    def cpu_ring(capacity, device):
        return ring_class(capacity, device, alloc=lambda n: torch.empty(n, dtype=torch.uint8),
                               copy=lambda staged, dev: staged.clone(), new_event=DoneEvent)
    monkeypatch.setattr(tool, "PinnedRing", cpu_ring)
    monkeypatch.setattr(tool, "lag", lambda device, ms: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())


def test_race_check_counts_and_compares(cpu_stand_ins):
    r = tool.race_check(torch.device("cpu"), copies=200, ring_kib=16)
    assert r["copies"] == 200 and r["mismatched"] == 0 and r["wraps"] > 0 and r["waits"] == 0


def test_costs_and_their_table(cpu_stand_ins):
    ring = tool.PinnedRing(8 * 2**20, torch.device("cpu"))
    costs = {w: {"alone": tool.copy_cost(torch.device("cpu"), w, 2, False, ring),
                 "contended": tool.copy_cost(torch.device("cpu"), w, 2, True, ring)} for w in tool.WAYS}
    assert all(v > 0 for c in costs.values() for v in c.values())
    table = tool.cost_table(costs).splitlines()
    assert table[0].startswith("| way |") and [row.split(" | ")[0] for row in table[2:]] == \
        ["| pin each", "| ring", "| pageable", "| launch only"]


def test_refuses_without_cuda(capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")   # main sets the allocator's default when unset
    assert tool.main(["--device", "cpu"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out
