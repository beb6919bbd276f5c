"""train.late_readback: the step's figures read one step late, the non-finite skip decided on the
device by fused AdamW. Step for step the same statuses, losses, norms, weights and optimizer state
as the read-back step (a skipped step included, under a constant learning rate); west-train logs
every step once and ends with the same weights; what cannot skip on the device is refused."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from west.schema import ConfigError
from west.train.late_readback import check_fused, queue_train_step
from west.train.step import plan_step, train_step

from helpers.e2e import TINY_CPU, assert_same_final_weights, assert_same_steps, eager_and_graphed, read_jsonl, tiny_llm
from helpers.fakes import TokenModel
from helpers.steps import SAMPLES, micro_batches


def _run(model: TokenModel, late: bool, poisoned: set[int]) -> tuple[list, torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    step = queue_train_step if late else train_step
    results, pending = [], None
    for i in range(4):
        model.poison = i in poisoned
        batches = micro_batches(SAMPLES, 4, "pack")
        plan = plan_step(batches, len(batches))
        out = step(model, batches, plan, opt, sched, device=torch.device("cpu"), world_size=1, grad_clip=1.0)
        if late:   # read the step before once this one is queued, as the loop does
            if pending is not None:
                results.append(pending.result())
            pending = out
        else:
            results.append(out)
    if pending is not None:
        results.append(pending.result())
    return results, opt


def test_late_steps_update_as_the_read_back_ones_a_skipped_step_included():
    torch.manual_seed(0)
    first = TokenModel()
    second = copy.deepcopy(first)
    want, want_opt = _run(first, late=False, poisoned={1})
    got, got_opt = _run(second, late=True, poisoned={1})
    assert [r.status for r in want] == [r.status for r in got] == ["ok", "nonfinite", "ok", "ok"]
    for a, b in zip(want, got):
        assert (a.n_tokens, a.n_correct, a.counters, a.lr) == (b.n_tokens, b.n_correct, b.counters, b.lr)
        assert (a.loss, a.grad_norm) == pytest.approx((b.loss, b.grad_norm), rel=0, abs=0, nan_ok=True)
    for (name, p), q in zip(first.named_parameters(), second.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        for key, value in want_opt.state[p].items():   # the skipped step left AdamW's state as it was
            torch.testing.assert_close(got_opt.state[q][key], value, rtol=0, atol=0, msg=f"{name} {key}")
    assert float(want_opt.state[next(first.parameters())]["step"]) == 3


def test_what_cannot_skip_on_the_device_is_refused(tmp_path_factory):
    from west.config import load_config, split_overrides

    model = TokenModel()
    with pytest.raises(ConfigError, match="train.late_readback: needs fused AdamW"):
        check_fused(torch.optim.SGD(model.parameters(), lr=0.1))
    check_fused(torch.optim.AdamW(model.parameters(), fused=True))
    argv = ["--model.llm.path", str(tiny_llm(tmp_path_factory)), "--train.late_readback", "true", "--train.fsdp", "true"]
    with pytest.raises(ConfigError, match="train.late_readback: not with train.fsdp"):
        load_config(str(TINY_CPU), split_overrides(argv))


def test_west_train_logs_every_step_once_and_trains_the_same_weights(tmp_path_factory, corpus, monkeypatch):
    """A step is logged once the next one is queued, and before a checkpoint, an epoch's end or the run's
    end (saves at steps 2 and 4)."""
    from west.train import loop
    from west.train.metrics import MetricsLogger

    events, log_step, queue = [], MetricsLogger.log_step, loop.queue_train_step

    def queued(*args, **kwargs):
        events.append("queue")
        return queue(*args, **kwargs)

    def logged(self, rec):
        events.append(f"log {rec['step']}")
        return log_step(self, rec)

    monkeypatch.setattr(loop, "queue_train_step", queued)
    monkeypatch.setattr(MetricsLogger, "log_step", logged)
    common = ["--batch_type", "pack", "--pack_tokens", "200", "--max_steps", "5", "--train.save_every", "2",
              "--train.eval_every", "0"]
    d, out = eager_and_graphed(tmp_path_factory, corpus, "late_readback", common, ["--train.late_readback", "true"])
    # the read-back run, then the late one: its epochs are 3 packs, so step 3 is logged at the epoch's end
    assert events == [f"log {k}" for k in range(1, 6)] + [
        "queue", "queue", "log 1", "log 2", "queue", "log 3", "queue", "log 4", "queue", "log 5"]
    assert [json["epoch"] for json in read_jsonl(d / "graphs" / "train_log.jsonl")] == [0, 0, 0, 1, 1]
    assert_same_steps(d, 5, "computed_llm_tokens")
    assert_same_final_weights(d, 5, atol=0)   # saved at steps 2 and 4 on the way, each after its figures
    want, got = (read_jsonl(d / run / "train_log.jsonl") for run in ("eager", "graphs"))
    assert [(x["loss"], x["grad_norm"], x["lr"]) for x in got] == [(x["loss"], x["grad_norm"], x["lr"]) for x in want]


def test_the_benchmark_times_late_steps_as_west_train_runs_them(monkeypatch):
    """west-benchmark's timed passes honour train.late_readback (west.bench.runner): each step queued
    before the one before is read, the same losses as reading back each step, one time per step,
    and the times sum to the pass."""
    import west.bench.runner as runner_mod
    from west.bench.runner import PassRunner
    from west.train.config import TrainConfig

    from helpers.speech import packed_batch, samples, tiny_model

    batches = [packed_batch(samples()[:2], 200), packed_batch(samples()[2:4], 200), packed_batch(samples()[4:], 200)]
    queued = []
    monkeypatch.setattr(runner_mod, "queue_train_step", lambda *a, **k: queued.append(1) or queue_train_step(*a, **k))
    passes, calls = {}, {}
    for late in (False, True):
        queued.clear()
        torch.manual_seed(0)
        train = TrainConfig(grad_clip=0.5, warmup_steps=1, late_readback=late)
        passes[late] = PassRunner(tiny_model(), train, torch.device("cpu"), seed=0).run(batches, warmup_steps=1)
        calls[late] = len(queued)
    assert calls == {False: 0, True: len(batches)}   # the timed steps, not the warm-up
    read_back, late = passes[False], passes[True]
    assert len(late["step_s"]) == len(read_back["step_s"]) == len(batches)
    assert late["mean_loss"] == read_back["mean_loss"] and math.isfinite(late["mean_loss"])
    assert sum(late["step_s"]) == pytest.approx(late["time_s"], rel=0.05)
    assert late["sync_wait_s"] >= 0 and late["launch_s"] > 0
