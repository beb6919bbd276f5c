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
