"""west's PackedTrainer on 2 ranks (torchrun's environment, gloo, DDP on the CPU): each rank trains
its own packed rows from the dp-balanced sampler (two, accumulated), and the step equals one
unpacked step over all the samples in one process (every weight: one per-token mean across rows
and ranks)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import Trainer

from helpers.hf import PAD, Tokenized, args, model_for, pad_collate, weights
from helpers.ranks import rank_results, run_ranks

N_SAMPLES = 12
ROWS_PER_RANK = 2   # accumulated into the one step: every rank's every row counts


def _worker(rank: int, world: int, port: int, out_dir: str, pack_length: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)   # a child forked from a process that made one must not reuse it
    PartialState._reset_state()
    from west.hf import PackedTrainer

    model = model_for("qwen2", packed=True)
    trainer = PackedTrainer(model=model, args=args(Path(out_dir) / f"r{rank}", max_steps=1, ddp_backend="gloo",
                                                          gradient_accumulation_steps=ROWS_PER_RANK),
                            train_dataset=Tokenized(N_SAMPLES), pack_length=pack_length, pad_token_id=PAD)
    trainer.train()
    rows = [list(b) for b in trainer.packed_sampler]
    torch.save({"weights": weights(model), "rows": rows, "world": trainer.args.world_size,
                "loss": trainer.state.log_history[0]["loss"]}, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.barrier()


@pytest.mark.timeout(300)
def test_two_ranks_step_equals_one_unpacked_step(tmp_path):
    data = Tokenized(N_SAMPLES)
    total = sum(len(x["input_ids"]) for x in data.items)
    start = weights(model_for("qwen2", packed=False))
    ref_model = model_for("qwen2", packed=False)
    ref = Trainer(model=ref_model, args=args(tmp_path / "ref", max_steps=1, per_device_train_batch_size=N_SAMPLES),
                  train_dataset=data, data_collator=pad_collate)
    ref.train()

    # rows of about a quarter of the tokens: two rows per rank, the four holding every sample once
    run_ranks(_worker, str(tmp_path), total // 4 + 30)
    got = rank_results(tmp_path)
    assert [r["world"] for r in got] == [2, 2] and [len(r["rows"]) for r in got] == [ROWS_PER_RANK] * 2
    assert sorted(i for r in got for row in r["rows"] for i in row) == list(range(N_SAMPLES))
    for name, w0 in start.items():   # SGD, lr 1: the update is the gradient, averaged by DDP
        g_ref = w0 - dict(ref_model.named_parameters())[name].detach()
        for r in got:
            assert torch.allclose(w0 - r["weights"][name], g_ref, rtol=1e-4, atol=1e-6), name


class _Samples(Tokenized):
    """Three long samples: one per row, so two ranks make two steps and one row has no sample."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.items = [{"input_ids": (ids := torch.randint(1, 64, (n,), generator=g).tolist()), "labels": ids}
                      for n in (30, 26, 28)]


def _odd_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    from west.hf import PackedTrainer

    model = model_for("qwen2", packed=True)
    trainer = PackedTrainer(model=model, args=args(Path(out_dir) / f"r{rank}", num_train_epochs=1, ddp_backend="gloo"),
                            train_dataset=_Samples(), pack_length=32, pad_token_id=PAD)
    trainer.train()
    torch.save({"weights": weights(model), "rows": trainer.packed_sampler.rows(0),
                "steps": trainer.state.global_step}, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.barrier()


@pytest.mark.timeout(300)
def test_two_ranks_three_long_samples_a_row_without_samples_adds_nothing(tmp_path):
    run_ranks(_odd_worker, str(tmp_path))
    got = rank_results(tmp_path)
    assert [r["steps"] for r in got] == [2, 2]
    dummies = [row for r in got for row in r["rows"] if row[0] < 0]
    assert len(dummies) == 1
    groups = [[i for r in got for i in r["rows"][s] if i >= 0] for s in range(2)]   # each step's real samples
    assert sorted(i for g in groups for i in g) == [0, 1, 2]

    class StepGroups(Trainer):   # the reference: each step's real samples in one padded batch, one process
        def get_train_dataloader(self):
            return torch.utils.data.DataLoader(self.train_dataset, batch_sampler=groups, collate_fn=pad_collate)

    ref_model = model_for("qwen2", packed=False)
    StepGroups(model=ref_model, args=args(tmp_path / "ref", num_train_epochs=1), train_dataset=_Samples()).train()
    for name, p in ref_model.named_parameters():
        for r in got:
            assert torch.allclose(r["weights"][name], p.detach(), rtol=1e-4, atol=1e-6), name
