"""tools/average_checkpoints.py: the mean of the chosen checkpoints' weights, best/last selection,
and the errors a user meets (no checkpoints, too few, no dev metric)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers.e2e import TINY_CPU, tiny_llm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import average_checkpoints as avg  # noqa: E402

# step -> dev figures in meta.json ("eval"); step 40 was saved without an evaluation
EVALS = {10: {"cv_loss": 3.0, "cv_cer": 0.5}, 20: {"cv_loss": 1.0, "cv_cer": 0.6},
         30: {"cv_loss": 2.0, "cv_cer": 0.2}, 40: None}


def fake_run(root: Path, evals: dict) -> Path:
    """A run dir whose checkpoints hold only meta.json: enough for the selection."""
    for step, ev in evals.items():
        d = root / "checkpoints" / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"step": step, "epoch": 0, **({"eval": ev} if ev else {})}))
    return root


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A real run dir: config.yaml of the tiny CPU recipe and two checkpoints (steps 5 and 9) of
    the tiny SpeechLLM with different random weights, saved by west-train's own saver."""
    from west.checkpoint.training import save_checkpoint
    from west.config import load_config
    from west.models.speech_llm import SpeechLLM
    from west.train.rundir import save_config

    run = tmp_path_factory.mktemp("run")
    cfg = load_config(str(TINY_CPU), [("model.llm.path", str(tiny_llm(tmp_path_factory)))])
    save_config(cfg, run)
    model = SpeechLLM(cfg.model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    states = {}
    for step, seed, ev in ((5, 1, {"cv_loss": 2.5}), (9, 2, {"cv_loss": 2.0})):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        save_checkpoint(run / "checkpoints", step, model=model, optimizer=opt, scheduler=sched,
                        data_state={}, meta={"epoch": 0, "eval": ev}, keep_last=5)
    return run, states


def test_average_of_two_checkpoints_is_the_mean_of_their_weights(trained_run, tmp_path, capsys):
    from west.infer.load import load_for_decoding

    run, states = trained_run
    out = tmp_path / "avg"
    assert avg.main([str(run), str(out), "--num", "2", "--mode", "last"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"averaged 2 checkpoint(s) (last): step 5 (cv_loss 2.5000); step 9 (cv_loss 2.0000) -> {out}"
    # what west-decode loads from OUT_DIR
    model, tokenizer, data_cfg = load_for_decoding(str(out), device="cpu")
    got = model.state_dict()
    assert set(got) == set(states[5])
    for name, a in states[5].items():
        b = states[9][name]
        want = ((a.to(torch.float64) + b.to(torch.float64)) / 2).to(a.dtype)
        assert got[name].dtype == a.dtype and torch.equal(got[name], want), name
    assert tokenizer.encode("hello") and data_cfg.prompt.endswith("Transcribe the speech.")
    assert (out / "config.yaml").read_text() == (run / "config.yaml").read_text()
    record = json.loads((out / "averaged.json").read_text())
    assert record["steps"] == [5, 9] and record["mode"] == "last" and record["not_averaged"] == []
    assert [c["eval"] for c in record["checkpoints"]] == [{"cv_loss": 2.5}, {"cv_loss": 2.0}]


def test_float64_accumulation_dtype_cast_and_integer_tensors(tmp_path, capsys):
    """bf16 sums in float64 and is rounded once; an int buffer comes from the newest checkpoint."""
    vals = [torch.tensor([1.0, 3.0, 0.1], dtype=torch.bfloat16), torch.tensor([2.0, 5.0, 0.2], dtype=torch.bfloat16),
            torch.tensor([4.0, 7.0, 0.4], dtype=torch.bfloat16)]
    paths = []
    for i, v in enumerate(vals):
        d = tmp_path / f"c{i}"
        d.mkdir()
        save_file({"w": v, "count": torch.tensor([i], dtype=torch.int64)}, str(d / "model.safetensors"))
        paths.append(d)
    state, kept = avg.average_state_dicts(paths)
    want = (sum(v.to(torch.float64) for v in vals) / 3).to(torch.bfloat16)
    assert state["w"].dtype == torch.bfloat16 and torch.equal(state["w"], want)
    assert kept == ["count"] and state["count"].tolist() == [2]


def test_average_refuses_different_models(tmp_path):
    for i, shape in enumerate(((2,), (3,))):
        (tmp_path / f"c{i}").mkdir()
        save_file({"w": torch.zeros(shape)}, str(tmp_path / f"c{i}" / "model.safetensors"))
    with pytest.raises(avg.AverageError, match="w is"):
        avg.average_state_dicts([tmp_path / "c0", tmp_path / "c1"])


@pytest.mark.parametrize("num,mode,metric,steps", [
    (2, "best", "cv_loss", [20, 30]),
    (2, "best", "cv_cer", [30, 10]),
    (1, "best", "cv_cer", [30]),
    (2, "last", "cv_cer", [30, 40]),     # last ignores the metric (40 has none)
    (4, "last", "cv_loss", [10, 20, 30, 40]),
])
def test_selection_best_and_last(tmp_path, num, mode, metric, steps):
    chosen, note = avg.select_checkpoints(fake_run(tmp_path, EVALS), num, mode, metric)
    assert [m["step"] for _, m in chosen] == steps and note == ""


def test_best_prefers_the_older_checkpoint_on_a_tie(tmp_path):
    """The same ranking as west-train's keep_best, so the chosen ones are among those it kept."""
    run = fake_run(tmp_path, {10: {"cv_loss": 1.0}, 20: {"cv_loss": 1.0}, 30: {"cv_loss": 0.5}})
    chosen, _ = avg.select_checkpoints(run, 2, "best", "cv_loss")
    assert [m["step"] for _, m in chosen] == [30, 10]


def test_fewer_checkpoints_than_asked_averages_what_exists(tmp_path):
    run = fake_run(tmp_path, EVALS)
    chosen, note = avg.select_checkpoints(run, 5, "best", "cv_loss")
    assert [m["step"] for _, m in chosen] == [20, 30, 10]
    assert note == "asked for 5, the run has only 3 checkpoint(s) with a dev cv_loss: averaging 3"
    chosen, note = avg.select_checkpoints(run, 6, "last", "cv_loss")
    assert len(chosen) == 4 and "only 4 checkpoint(s): averaging 4" in note


def test_fewer_than_asked_end_to_end_says_so(trained_run, tmp_path, capsys):
    run, _ = trained_run
    assert avg.main([str(run), str(tmp_path / "avg"), "--num", "3", "--mode", "best"]) == 0
    out, err = capsys.readouterr()
    assert "asked for 3, the run has only 2 checkpoint(s) with a dev cv_loss: averaging 2" in err
    assert out.startswith("averaged 2 checkpoint(s) (best by cv_loss): step 9 (cv_loss 2.0000); step 5")
    assert json.loads((tmp_path / "avg" / "averaged.json").read_text())["steps"] == [9, 5]


def test_errors_exit_2_with_a_clear_message(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.yaml").write_text("model: {}\n")
    assert avg.main([str(empty), str(tmp_path / "o1"), "--num", "2"]) == 2
    assert "no checkpoints in" in capsys.readouterr().err

    run = fake_run(tmp_path / "noeval", {10: None, 20: {"cv_loss": 1.0}})
    (run / "config.yaml").write_text("model: {}\n")
    assert avg.main([str(run), str(tmp_path / "o2"), "--metric", "cv_cer"]) == 2
    err = capsys.readouterr().err
    assert "--metric cv_cer" in err and "none of the 2 checkpoint(s)" in err and "--mode last" in err
    assert not (tmp_path / "o2").exists()

    assert avg.main([str(fake_run(tmp_path / "noconf", EVALS)), str(tmp_path / "o3")]) == 2
    assert "config.yaml is missing" in capsys.readouterr().err
    assert avg.main([str(run), str(tmp_path / "o4"), "--num", "0"]) == 2
    assert "--num must be at least 1" in capsys.readouterr().err
