"""west.lab.phase_marks: the phase boundaries of a real step, and the lag arithmetic that reads
a GPU's marks (fed by hand here: the CPU has no second clock)."""
from __future__ import annotations

import pytest
import torch

from west.lab.phase_marks import StepClock
from west.lab.phase_table import lag_table, phases, summarize
from west.train.step import plan_step, train_step

from helpers.speech import packed_batch, padded_batch, samples, tiny_model

PACKED_ORDER = ["batch to device", "input embeddings", "encoder forward", "encoder rows", "projector", "splice",
                "LLM forward", "loss", "loss backward", "LLM backward", "splice, projector backward",
                "encoder backward, clip, read-back", "optimizer", "step end"]


def marked_step(model, batch, clock: StepClock) -> list[dict]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with clock.around_step(model, opt):
        train_step(model, [batch], plan_step([batch], 1), opt, sched, device=torch.device("cpu"), world_size=1,
                   grad_clip=1.0)
    return clock.last


@pytest.mark.parametrize("layout", ["pack", "padded"])
def test_every_boundary_of_a_real_step_is_marked_in_order_and_the_hooks_go_away(layout):
    model = tiny_model()
    batch = packed_batch(samples(), 256) if layout == "pack" else padded_batch(samples())
    forward_flat = model.encoder.forward_flat
    got = marked_step(model, batch, StepClock(cuda=False))
    assert [p["phase"] for p in got] == PACKED_ORDER
    assert all(p["host_ms"] >= 0 and p["gpu_ms"] == p["host_ms"] and p["lag_end_ms"] == 0 for p in got)
    assert got[PACKED_ORDER.index("encoder forward")]["host_ms"] > 0
    # nothing stays behind: no module hooks, the encoder's own method back, no marks
    assert model.encoder.forward_flat == forward_flat and "forward_flat" not in vars(model.encoder)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    clock = StepClock(cuda=False)
    model(batch)["loss_sum"].backward()   # unhooked: no marks
    assert clock.read() == []


def test_lags_say_which_phases_the_host_paces():
    # (mark, host ms, GPU ms): the GPU reaches a mark after the host queued it
    step = [("step", 0.0, 0.01), ("forward/encoder", 1.0, 1.02), ("after forward/encoder", 5.0, 12.0),
            ("forward/llm", 11.9, 12.2), ("end", 20.0, 20.3)]
    got = phases(step)
    assert [p["phase"] for p in got] == ["batch to device", "encoder forward", "encoder rows", "LLM forward"]
    assert got[1] == pytest.approx({"phase": "encoder forward", "host_ms": 4.0, "gpu_ms": 10.98,
                                    "lag_start_ms": 0.02, "lag_end_ms": 7.0}, abs=1e-9)
    slower = [(n, 2 * h, 2 * g) for n, h, g in step]   # a step twice as long: the medians are the others'
    res = summarize([got, phases(step), phases(slower)], gpu=True)
    assert [r["host_paced"] for r in res["phases"]] == [True, False, False, True]
    assert res["phases"][0]["host_ms"] == 1.0 and res["step_ms"] == pytest.approx(20.0)
    assert res["host_paced_ms"] == pytest.approx(1.0 + 8.1)
    text = lag_table(res)
    assert "| encoder forward | 4.0 | 11.0 | 0.0 | 7.0 |  |" in text and "9.1 ms of it in phases the host paces" in text
    # the median step, whole: its lags add up phase to phase, which the columns' medians need not
    odd = [dict(p, host_ms=p["host_ms"] + 3, lag_end_ms=p["lag_end_ms"] - 3) if p["phase"] == "encoder rows" else p
           for p in phases(step)]   # one step 3 ms longer in one phase, between the other two
    middle = summarize([phases(slower), odd, got], gpu=True)["median_step"]
    assert middle["step"] == 1 and middle["phases"] == odd
    assert all(p["lag_end_ms"] == pytest.approx(p["lag_start_ms"] + p["gpu_ms"] - p["host_ms"]) for p in got)
    assert "the step of median host time alone (step 0 of those read, 20.0 ms)" in text
    assert "| encoder forward | 4.0 | 11.0 | 0.0 | 7.0 |\n" in text
    cpu = summarize([got], gpu=False)
    assert cpu["host_paced_ms"] is None and cpu["phases"][0]["host_paced"] is None
    assert "no GPU" in lag_table(cpu)
    mixed = summarize([got[:2], got, phases(slower), got], gpu=True)   # e.g. a step of dummy batches: left out
    assert mixed["steps"] == 3 and mixed["left_out"] == 1 and len(mixed["phases"]) == 4
    assert "(1 with other phases left out)" in lag_table(mixed)
    with pytest.raises(ValueError, match="no steps"):
        summarize([], gpu=True)


def test_west_train_logs_each_steps_phases_and_step_summary_reads_them(tmp_path_factory, corpus, capsys):
    """west-train with the lab's phase marks (python -m west.lab.train --phase_marks --host_clock):
    every step's phases and the host's figures in train_log.jsonl, the dev evaluation between steps
    (the same model's forward) in none of them; tools/step_summary.py gives the table."""

    from west.lab.train import main

    from helpers.e2e import import_tool, read_jsonl, tiny_llm, train_argv, write_lists
    from helpers.threads import torch_threads

    d = tmp_path_factory.mktemp("marks")
    lists = write_lists(corpus["rows"], d / "lists", 13)
    with torch_threads():
        assert main(train_argv(tiny_llm(tmp_path_factory), lists.jsonl, d / "run", "--batch_type", "pack",
                               "--pack_tokens", "200", "--max_steps", "3", "--cv_data", str(lists.jsonl),
                               "--train.eval_every", "1", "--phase_marks", "--host_clock")) == 0
    log = read_jsonl(d / "run" / "train_log.jsonl")
    steps = [s for s in log if "event" not in s]
    assert len(steps) == 3 and sum(s.get("event") == "eval" for s in log) == 3
    for s in steps:
        marks = s["phase_marks"]
        assert marks["gpu"] is False and [p["phase"] for p in marks["phases"]] == PACKED_ORDER
        assert sum(p["host_ms"] for p in marks["phases"]) <= 1e3 * s["step_time_s"]
        assert s["host_cpu_ms"] > 0   # the host clock observer's figures (Linux gives the thread's)
    step_summary = import_tool("step_summary")
    capsys.readouterr()
    assert step_summary.main([str(d / "run" / "train_log.jsonl"), "--name", "marked", "--skip", "1"]) == 0
    out = capsys.readouterr().out
    assert "marked, phase by phase (west.lab.train --phase_marks)" in out and "| encoder backward, clip, read-back |" in out
    assert "2 steps, medians:" in out and "outside the phases and the loader's wait: " in out


def test_no_mark_while_a_cuda_graph_is_captured(monkeypatch):
    """train.encoder_graphs captures the encoder's blocks inside a step: no timing event may be
    recorded into the graph, so the marks skip the capture (checked with the capture faked)."""
    def no_event(*args, **kwargs):
        raise AssertionError("an event was made during the capture")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", no_event)
    clock = StepClock(cuda=True)
    clock.mark("forward/llm")
    assert clock.marks == []
