"""tools/bench_loss.py: every implementation runnable here is timed on the same inputs and checked
against plain (loss, argmax count, hidden's gradient); the CUDA libraries are reported as not run,
with the reason, instead of silently missing from the table."""
import json

import pytest
import torch

from helpers.e2e import import_tool

bench_loss = import_tool("bench_loss")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_chunked_against_plain_in_every_configuration(tmp_path, capsys):
    out = tmp_path / "loss.json"
    bench_loss.main(["--rows", "40,130", "--hidden", "16", "--vocab", "700", "--configs", "bf16,autocast,fp32",
                     "--weights", "frozen,trains", "--chunk_rows", "32", "--repeats", "1", "--device", "cpu",
                     "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["results"]
    assert len(rows) == 2 * 3 * 2 * 2   # rows x configs x weights x (plain, chunked)
    assert report["skipped"] == {"liger": "CUDA only", "cce": "CUDA only"}
    for r in rows:
        assert r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 and r["correct_equal"]
        if r["impl"] == "plain":
            assert r["loss_rel_diff"] == 0 and r["grad_h_rel_diff"] == 0
        else:   # 130 rows make 5 chunks of 32
            assert r["loss_rel_diff"] < 1e-5
            # float32: the same sums; bf16 autocast: (softmax - one_hot) rounded before grad_loss scales it
            assert r["grad_h_rel_diff"] < (1e-5 if r["config"] == "fp32" else 1e-2)
    text = capsys.readouterr().out
    assert "| 130 | fp32 | trains | chunked |" in text and "- liger not run: CUDA only" in text
    assert text.rstrip().splitlines()[-1].startswith("fastest forward + backward: 40 rows bf16 frozen: ")


def test_a_library_that_is_not_installed_is_named(monkeypatch):
    monkeypatch.setattr(bench_loss.loss_mod, "_library_fn", lambda impl: None)
    run, skipped = bench_loss.available_impls(["plain", "liger", "cce", "chunked"], torch.device("cuda"))
    assert run == ["plain", "chunked"]
    assert skipped == {"liger": "liger-kernel is not importable", "cce": "cut-cross-entropy is not importable"}


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        bench_loss.main(["--configs", "fp16"])
    with pytest.raises(SystemExit):
        bench_loss.main(["--weights", "frozen,thawed"])
