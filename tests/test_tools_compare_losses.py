"""tools/compare_losses.py: two west-train logs step by step (the suite's encoder_graphs_exact): the
losses side by side, the largest relative difference, steps that only one run has, bad records."""
import json

import pytest

from helpers.e2e import import_tool

compare_losses = import_tool("compare_losses")


def write_log(path, losses, extra=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    recs = [dict(step=i + 1, status="ok", loss=v) for i, v in enumerate(losses)] + list(extra)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def test_largest_difference_and_exit_status(tmp_path, capsys):
    a = write_log(tmp_path / "eager" / "train_log.jsonl", [10.0, 9.0, 8.0],
                  [{"event": "eval", "step": 3, "loss": 1.0}, dict(step=4, status="nonfinite", loss=float("nan"))])
    b = write_log(tmp_path / "graphs" / "train_log.jsonl", [10.0, 9.009, 8.0])
    out = tmp_path / "cmp.json"
    assert compare_losses.main([str(a), str(b), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| step | eager loss | graphs loss | relative difference |" in text
    assert "[compare_losses] 3 steps: largest relative difference 1.0e-03 (step 2), at step 1 0.0e+00" in text
    res = json.loads(out.read_text(encoding="utf-8"))
    assert res["worst"]["step"] == 2 and res["worst"]["rel"] == pytest.approx(1e-3)
    assert compare_losses.main([str(a), str(b), "--rtol", "2e-3"]) == 0
    assert compare_losses.main([str(a), str(b), "--rtol", "5e-4"]) == 1
    short = write_log(tmp_path / "short" / "train_log.jsonl", [10.0, 9.0])
    assert compare_losses.main([str(a), str(short), "--rtol", "1"]) == 1   # step 3 missing is not a pass
    assert "steps in one run only: [3]" in capsys.readouterr().out


def test_a_step_record_without_a_loss_names_its_line(tmp_path):
    bad = write_log(tmp_path / "train_log.jsonl", [10.0], [dict(step=2, status="ok")])
    with pytest.raises(SystemExit, match=r"train_log.jsonl:2: a step record without"):
        compare_losses.step_losses(bad)
