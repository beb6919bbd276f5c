"""tools/plot_curves.py: a PNG from a run's train_log.jsonl (step lines and dev "eval" lines)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import plot_curves  # noqa: E402


def write_log(run: Path, steps: int = 60, eval_every: int = 20, cer: bool = True) -> Path:
    """A train_log.jsonl as west-train writes it: a step line per step, an eval line per evaluation,
    a step re-logged after a resume and a torn last line (kill -9)."""
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for s in range(1, steps + 1):
        lines.append({"step": s, "epoch": 0, "loss": 5.0 / s ** 0.5, "lr": 1e-3, "tokens": 100})
        if s % eval_every == 0:
            ev = {"step": s, "epoch": 0, "event": "eval", "cv_loss": 4.0 / s ** 0.3, "cv_acc": 0.5,
                  "cv_tokens": 50, "cv_utts": 4, "cv_decoded_utts": 4, "eval_s": 0.1}
            if cer:
                ev["cv_cer"] = 1.0 / s ** 0.2
            lines.append(ev)
    lines.append({"step": 3, "epoch": 0, "loss": 1.0})     # resumed run: the last line of a step wins
    text = "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 61, "lo'
    (run / "train_log.jsonl").write_text(text, encoding="utf-8")
    return run


def test_read_log_splits_steps_and_evals(tmp_path):
    run = write_log(tmp_path / "run")
    train, evals = plot_curves.read_log(run / "train_log.jsonl")
    assert [s for s, _ in train] == list(range(1, 61)) and dict(train)[3] == 1.0
    assert [e["step"] for e in evals] == [20, 40, 60] and all("cv_cer" in e for e in evals)


@pytest.mark.parametrize("cer", [True, False])
def test_plot_writes_png_and_prints_its_path(tmp_path, capsys, cer):
    run = write_log(tmp_path / "run", cer=cer)
    assert plot_curves.main([str(run)]) == 0
    png = run / "curves.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "elsewhere" / "c.png"
    assert plot_curves.main([str(run), "--out", str(out)]) == 0 and out.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_eval_lines(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10}) + "\n"
                                                 for s in range(1, 6)))
    assert plot_curves.plot_curves(run, run / "c.png").stat().st_size > 1000


def test_smooth_is_a_trailing_mean():
    assert plot_curves.smooth([1, 3, 5, 7], 2) == [1, 2, 4, 6]


def test_missing_or_empty_log_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_curves.py"), str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert f"{tmp_path / 'train_log.jsonl'} is missing" in r.stderr
    (tmp_path / "train_log.jsonl").write_text('{"step": 1, "event": "eval", "cv_acc": 0.1}\n')
    with pytest.raises(ValueError, match="no training loss and no dev loss"):
        plot_curves.plot_curves(tmp_path, tmp_path / "c.png")
