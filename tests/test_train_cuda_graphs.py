"""train.cuda_graphs through west-train on the CPU: every packed row runs the frozen LLM padded to
data.pack_tokens (what one captured graph replays on CUDA), and the run's per-step losses and final
weights are those of the same run unpadded; the last line counts the rows."""

from helpers.e2e import assert_same_final_weights, assert_same_steps, eager_and_graphed

FROZEN_PACK = ["--batch_type", "pack", "--pack_tokens", "200", "--max_steps", "4", "--model.freeze_llm", "true",
               "--train.save_every", "0"]


def test_padded_llm_rows_train_like_unpadded_ones(tmp_path_factory, corpus):
    d, out = eager_and_graphed(tmp_path_factory, corpus, "graphs", FROZEN_PACK, [
        "--train.cuda_graphs", "true", "--train.graph_segments", "32", "--train.graph_max_seqlen", "128"])
    assert_same_steps(d, 4, "computed_llm_tokens")
    assert_same_final_weights(d, 4, atol=1e-6)
    assert "4 LLM rows padded (eager) at 200 tokens, 0 unpadded (train.cuda_graphs)" in out["graphs"]
    assert "train.cuda_graphs" not in out["eager"]
