"""Process-group helpers: single-process no-ops, and a rank that never joins a collective
makes the others fail after the timeout instead of hanging."""
from __future__ import annotations

import os
import time

import pytest
import torch

from west import ranks as R
from west.train import distributed as D

from helpers.fakes import TokenModel
from helpers.ranks import init_gloo, run_ranks


def test_single_process_defaults(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = D.init_distributed("cpu")
    assert (info.rank, info.world_size, info.backend, info.is_main, info.distributed) == (0, 1, "", True, False)
    assert R.all_reduce_sum([1, 2.5]) == [1.0, 2.5]
    assert R.any_rank(True) and not R.any_rank(False) and R.all_ranks(True)
    assert R.sum_counts_over_ranks({"a": 1}) == {"a": 1}
    model = TokenModel()
    assert D.wrap_model(model, info) is model and R.unwrap(model) is model
    with D.grad_sync(model, enabled=False):
        pass
    R.barrier()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_requested_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        R.pick_device("cuda")
    assert R.pick_device("auto").type == "cpu"


def _timeout_worker(rank: int, world: int, port: int, out: str) -> None:
    init_gloo(rank, world, port, timeout_s=2)
    assert R.all_reduce_sum([rank]) == [1.0]  # both ranks present
    if rank == 1:  # alive but never joins the next collective; leaves once rank 0 gave up
        deadline = time.monotonic() + 60
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        try:
            R.any_rank(True)
            result = "returned"
        except RuntimeError as e:
            result = f"raised: {e}"
        with open(out + ".tmp", "w") as f:
            f.write(result)
        os.rename(out + ".tmp", out)
    D.cleanup()


def test_missing_rank_times_out_instead_of_hanging(tmp_path):
    out = tmp_path / "rank0.txt"
    run_ranks(_timeout_worker, str(out))
    assert out.read_text().startswith("raised"), out.read_text()
