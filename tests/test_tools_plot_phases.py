"""tools/plot_phases.py: a step's phases on a host lane and a GPU lane, from profile_step's JSON or
a west-train log with python -m west.lab.train --phase_marks (marks given by hand: the CPU has no second clock)."""
import json

import pytest

from west.lab.phase_table import phases, summarize

from helpers.e2e import import_tool

plot_phases = import_tool("plot_phases")

# (mark, host ms, GPU ms): the encoder host-paced, the LLM's forward run ahead of by the host
MARKS = [("step", 0.0, 0.0), ("forward/encoder", 1.0, 1.0), ("after forward/encoder", 30.0, 30.2),
         ("forward/llm", 31.0, 31.2), ("after forward/llm", 40.0, 70.0), ("end", 75.0, 75.1)]


def test_lanes_lay_the_phases_end_to_end_and_shift_the_gpu_by_the_lead():
    res = summarize([phases(MARKS)], gpu=True)
    spans = plot_phases.lanes(res)
    assert [s["phase"] for s in spans] == ["batch to device", "encoder forward", "encoder rows", "LLM forward", "loss"]
    llm = spans[3]
    assert llm["host"] == pytest.approx((31.0, 40.0)) and llm["gpu"] == pytest.approx((31.2, 70.0))
    assert spans[-1]["host"][1] == pytest.approx(75.0) and spans[-1]["gpu"][1] == pytest.approx(75.1)


def test_png_from_profile_step_json_and_from_a_train_log(tmp_path, capsys):
    res = summarize([phases(MARKS)] * 3, gpu=True)
    marks = tmp_path / "marks.json"
    marks.write_text(json.dumps({"modes": {"pack": {"phase_marks": res}, "static": {"other": 1}}}), encoding="utf-8")
    assert plot_phases.main([str(marks)]) == 0
    png = tmp_path / "phases.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and capsys.readouterr().out.strip() == str(png)
    log = tmp_path / "run" / "train_log.jsonl"
    log.parent.mkdir()
    steps = [{"step": i, "phase_marks": {"gpu": False, "phases": phases(MARKS)}} for i in range(1, 8)]
    log.write_text("\n".join(json.dumps(s) for s in steps + [{"event": "eval", "step": 7}]), encoding="utf-8")
    assert set(plot_phases.read_marks(log, skip=5)) == {"run"} and plot_phases.read_marks(log, skip=7) == {}
    assert plot_phases.main([str(log), "--out", str(tmp_path / "cpu.png")]) == 0 and (tmp_path / "cpu.png").is_file()
    assert plot_phases.main([str(tmp_path / "missing.jsonl")]) == 2
    assert "no phase marks" in capsys.readouterr().err
