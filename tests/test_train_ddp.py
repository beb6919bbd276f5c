"""Two gloo ranks in one spawn (DDP start-up is slow, so every 2-rank check shares it):
per-token loss vs the 1-process reference (DDP and FSDP2), NaN on one rank, equal steps
with uneven data, exactly-once audit, checkpoint resume, and the small collectives."""
from __future__ import annotations

import json

import pytest
import torch

from west.ranks import all_ranks, all_reduce_sum, any_rank, sum_counts_over_ranks
from west.train.config import RunConfig, TrainConfig
from west.train.distributed import cleanup, wrap_model
from west.train.loop import Trainer

from helpers.fakes import ListData, SimulatedCrash, TokenModel, make_batches
from helpers.ranks import init_gloo, rank_results, run_ranks
from helpers.steps import RANK_CUT, SAMPLES, assert_close, micro_batches, one_step, reference_params

BATCHES_PER_RANK = (5, 4)  # accum 2 -> 3 steps per epoch on both ranks (rank 1's last is all dummy)


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _trainer(out_dir: str, info, crash_at: int = -1, late_readback: bool = False) -> Trainer:
    train = TrainConfig(lr=1e-2, warmup_steps=2, max_epochs=2, accum_steps=2, save_every=2,
                        keep_last=3, tensorboard=False, progress_bar=False, log_every=1000, seed=1,
                        late_readback=late_readback)
    run = RunConfig(output_dir=out_dir, train_data="unused", resume="auto", audit=True)
    n = BATCHES_PER_RANK[info.rank]
    data = ListData(make_batches(n, seed=10 + info.rank, prefix=f"r{info.rank}_"), crash_at=crash_at)
    return Trainer(train, run, TokenModel(seed=0, dropout=0.2), data, info)


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    info = init_gloo(rank, world, port)
    res: dict = {}
    # 1. per-token loss: every layout / accumulation, DDP and FSDP2
    shares = [SAMPLES[:RANK_CUT], SAMPLES[RANK_CUT:]]
    for fsdp in (False, True):
        for accum in (1, 4):
            for layout in ("static", "dynamic", "pack"):
                if fsdp and layout != "pack":
                    continue
                model = wrap_model(TokenModel(), info, fsdp=fsdp)
                stats = one_step(model, micro_batches(shares[rank], accum, layout), world)
                res[f"w2-a{accum}-{layout}-fsdp{int(fsdp)}"] = {"params": _full_state(model), **stats}
    # 2. NaN on rank 1 only
    model = wrap_model(TokenModel(), info)
    model.module.poison = rank == 1
    res["nan"] = {"params": _full_state(model), **one_step(model, micro_batches(shares[rank], 1, "static"), world)}
    # 3. collectives
    res["helpers"] = {"any": any_rank(rank == 1), "all": all_ranks(rank == 0), "sum": all_reduce_sum([rank, 1]),
                      "counts": sum_counts_over_ranks({"bad_audio": 1, f"only_r{rank}": 2})}
    # 4. uninterrupted run, then crash at step 5 (both ranks fetching) and resume from step 4
    full = _trainer(f"{tmp}/full", info)
    res["full"] = {"summary": full.fit(), "losses": full.losses,
                   "replica": {k: v.clone() for k, v in full.model.module.state_dict().items()}}
    crash_at = (BATCHES_PER_RANK[rank] + 2)  # epoch 1, first batch of step 5
    crashed = _trainer(f"{tmp}/resume", info, crash_at=crash_at)
    try:
        crashed.fit()
        res["crashed"] = False
    except SimulatedCrash:
        res["crashed"] = True
    resumed = _trainer(f"{tmp}/resume", info)
    res["resumed"] = {"summary": resumed.fit(), "losses": resumed.losses,
                      "params": _full_state(resumed.model), "full_params": _full_state(full.model)}
    # 5. the uninterrupted run again, each step's figures read one step late (train.late_readback)
    late = _trainer(f"{tmp}/late", info, late_readback=True)
    res["late"] = {"summary": late.fit(), "losses": late.losses, "params": _full_state(late.model)}
    torch.save(res, f"{tmp}/rank{rank}.pt")
    cleanup()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    run_ranks(_worker, str(tmp))
    return tmp, rank_results(tmp)


def test_per_token_loss_two_ranks_matches_one_process(results):
    ref = reference_params()
    r0 = results[1][0]
    names = [k for k in r0 if k.startswith("w2-")]
    assert len(names) == 8  # 2 accum x 3 layouts with DDP + 2 accum with FSDP2
    for name in names:
        assert r0[name]["status"] == "ok", name
        assert r0[name]["utterances"] == len(SAMPLES), name  # counters summed over ranks
        assert_close(r0[name]["params"], ref, name)


def test_nan_on_one_rank_skips_the_step_on_both(results):
    for r in results[1]:
        assert r["nan"]["status"] == "nonfinite"
    assert_close(results[1][0]["nan"]["params"], TokenModel().state_dict(), "nan")


def test_collective_helpers(results):
    for r in results[1]:
        h = r["helpers"]
        assert h["any"] is True and h["all"] is False and h["sum"] == [1.0, 2.0]
        assert h["counts"] == {"bad_audio": 2, "only_r0": 2, "only_r1": 2}


def test_equal_steps_and_exactly_once_with_uneven_data(results):
    tmp, rs = results
    for r in rs:
        assert r["full"]["summary"]["step"] == 6  # 3 per epoch on both ranks
        assert r["full"]["losses"] == rs[0]["full"]["losses"]  # global loss, same on every rank
    # Same lr schedule and same averaged gradients: the DDP replicas never drift apart.
    assert_close(rs[1]["full"]["replica"], rs[0]["full"]["replica"], "replicas")
    log = [json.loads(line) for line in (tmp / "full" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3, 4, 5, 6]
    assert sum(x["utterances"] for x in log) == 2 * 3 * sum(BATCHES_PER_RANK)
    for epoch in (0, 1):
        keys = []
        for rank in (0, 1):
            for line in (tmp / "full" / "audit" / f"rank{rank}.jsonl").read_text().splitlines():
                rec = json.loads(line)
                if rec["epoch"] == epoch:
                    keys += rec["keys"]
        assert len(keys) == len(set(keys)) == 3 * sum(BATCHES_PER_RANK)


def test_two_rank_resume_continues_exactly(results):
    tmp, rs = results
    for r in rs:
        assert r["crashed"] is True
        assert r["resumed"]["summary"]["step"] == 6
        assert r["resumed"]["losses"] == r["full"]["losses"][4:]
    assert_close(rs[0]["resumed"]["params"], rs[0]["resumed"]["full_params"], "resumed vs full")
    log = [json.loads(line) for line in (tmp / "resume" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3, 4, 5, 6]


def test_late_readback_on_two_ranks_trains_as_the_read_back_run(results):
    """The same losses and weights with a rank feeding dummy batches at the epoch's end; the
    figures are summed over ranks on the device before either rank reads them."""
    _, ranks = results
    for r in ranks:
        assert r["late"]["summary"]["step"] == r["full"]["summary"]["step"]
        assert r["late"]["losses"] == r["full"]["losses"]
        assert_close(r["late"]["params"], r["resumed"]["full_params"], "late readback")
