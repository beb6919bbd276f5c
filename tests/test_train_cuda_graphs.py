"""train.cuda_graphs through west-train on the CPU: every packed row runs the frozen LLM padded to
data.pack_tokens (what one captured graph replays on CUDA), and the run's per-step losses and final
weights are those of the same run unpadded; the last line counts the rows."""
import contextlib
import io

import pytest
import torch
from safetensors.torch import load_file

from helpers.e2e import read_jsonl, tiny_llm, train_argv, write_lists
from helpers.threads import torch_threads

FROZEN_PACK = ["--batch_type", "pack", "--pack_tokens", "200", "--max_steps", "4", "--model.freeze_llm", "true",
               "--train.save_every", "0"]


def test_padded_llm_rows_train_like_unpadded_ones(tmp_path_factory, corpus):
    from west.bin.train import main

    d = tmp_path_factory.mktemp("graphs")
    lists = write_lists(corpus["rows"], d / "lists", 13)
    llm = tiny_llm(tmp_path_factory)
    out = {}
    with torch_threads():
        for name, extra in (("eager", []), ("graphs", ["--train.cuda_graphs", "true", "--train.graph_segments", "32",
                                                       "--train.graph_max_seqlen", "128"])):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                assert main(train_argv(llm, lists.jsonl, d / name, *FROZEN_PACK, *extra)) == 0
            out[name] = text.getvalue()
    want, got = (read_jsonl(d / n / "train_log.jsonl") for n in ("eager", "graphs"))
    assert [x["step"] for x in got] == [1, 2, 3, 4]
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["computed_llm_tokens"] == a["computed_llm_tokens"]   # the figures count the real row
    final = [load_file(str(d / n / "checkpoints" / "step_00000004" / "model.safetensors")) for n in ("eager", "graphs")]
    assert final[0].keys() == final[1].keys() and final[0]
    for k in final[0]:
        torch.testing.assert_close(final[1][k], final[0][k], rtol=1e-4, atol=1e-6, msg=k)
    assert "4 LLM rows padded (eager) at 200 tokens, 0 unpadded (train.cuda_graphs)" in out["graphs"]
    assert "train.cuda_graphs" not in out["eager"]
