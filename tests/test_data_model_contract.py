"""The batches meet the model: every batch mode gives the same summed loss.

If the data side placed a label, a position, a span or a segment boundary
differently in one mode, the per-token loss of the same utterances would
differ. Uses the tiny SpeechLLM from west.models (tests may import it).
"""
from __future__ import annotations

import pytest
import torch

from west.data.config import DataConfig
from west.data.dataset import build_dataloader
from west.shapes import SpeechShape

from helpers.e2e import tiny_encoder

SHAPE = SpeechShape()

MODES = {
    "static": dict(batch_type="static", batch_size=5),
    "dynamic": dict(batch_type="dynamic", max_tokens_in_batch=300),
    "pack": dict(batch_type="pack", pack_tokens=400),
    "pack, encoder padded": dict(batch_type="pack", pack_tokens=400, encoder_layout="padded"),
    "pack, shared prompt prefix": dict(batch_type="pack", pack_tokens=400, shared_prefix=True),
}


@pytest.fixture(scope="module")
def model(tokenizer):
    from west.models.config import LLMConfig, ProjectorConfig, SpeechLLMConfig
    from west.models.speech_llm import SpeechLLM

    torch.manual_seed(0)
    llm = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    cfg = SpeechLLMConfig(encoder=tiny_encoder(dropout=0.0),
                          projector=ProjectorConfig(stride=2, hidden_dim=48),
                          llm=LLMConfig(config=llm), freeze_llm=False, ctc_weight=0.3)
    return SpeechLLM(cfg).eval()


def test_every_mode_gives_the_same_loss(corpus, tokenizer, model):
    """CE + 0.3 CTC: the CTC targets travel with their speech segments in every mode."""
    totals = {}
    for name, kw in MODES.items():
        loader, _ = build_dataloader(str(corpus["list"]), tokenizer, DataConfig(**kw), model.cfg.speech_shape(),
                                     training=False)
        loss, n = 0.0, 0
        with torch.no_grad():
            for batch in loader:
                out = model(batch)
                assert int(out["n_tokens"]) == batch.counters["label_tokens"]
                assert out["ctc_utts"] == len(batch.keys) and out["ctc_infeasible"] == 0
                texts = [tokenizer(corpus["texts"][k], add_special_tokens=False)["input_ids"] for k in batch.keys]
                assert batch.ctc_target_lens.tolist() == [len(t) for t in texts]
                assert batch.ctc_targets.tolist() == [x for t in texts for x in t]
                loss += float(out["loss_sum"])
                n += int(out["n_tokens"])
        totals[name] = (loss, n)
    ref_loss, ref_n = totals["static"]
    for name, (loss, n) in totals.items():
        assert n == ref_n, name
        assert loss == pytest.approx(ref_loss, rel=1e-5), name


@pytest.mark.parametrize("batch_type", ["static", "pack"])
def test_dummy_batch_runs_backward_and_counts_nothing(corpus, tokenizer, model, batch_type):
    _, ds = build_dataloader(str(corpus["list"]), tokenizer, DataConfig(batch_type=batch_type, pack_tokens=64),
                             SHAPE)
    out = model(ds.dummy_batch())
    assert int(out["n_tokens"]) == 0 and out["loss_sum"].item() == 0.0
    out["loss_sum"].backward()     # DDP needs a backward on every rank, even with nothing to learn
    model.zero_grad(set_to_none=True)


def _gradients(model, batches) -> dict:
    model.zero_grad(set_to_none=True)
    for batch in batches:
        model(batch)["loss_sum"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("backend", ["sdpa_segments", "flash"])   # flash: its pure-torch reference here
def test_shared_prompt_prefix_trains_what_the_whole_prompt_trains(corpus, tokenizer, model, backend, monkeypatch):
    """The same utterances packed with and without data.shared_prefix: the same loss and the same
    gradients of every weight, the LLM's included (what the prefix's keys pass back is summed over the
    samples that read them), though the rows hold the prefix once."""
    monkeypatch.setattr(model.cfg.llm, "attn_backend", backend)
    runs = {}
    for shared in (False, True):
        conf = DataConfig(batch_type="pack", pack_tokens=400, shared_prefix=shared)
        loader, _ = build_dataloader(str(corpus["list"]), tokenizer, conf, model.cfg.speech_shape(), training=False)
        batches = list(loader)
        runs[shared] = (batches, _gradients(model, batches))
    (plain, g_plain), (shared, g_shared) = runs[False], runs[True]
    assert sorted(k for b in plain for k in b.keys) == sorted(k for b in shared for k in b.keys)
    assert all(b.key_index is not None for b in shared) and all(b.key_index is None for b in plain)
    assert sum(b.counters["real_llm_tokens"] for b in shared) < sum(b.counters["real_llm_tokens"] for b in plain)
    assert g_plain.keys() == g_shared.keys() and any("llm" in n for n in g_plain)
    for name, g in g_plain.items():
        torch.testing.assert_close(g_shared[name], g, rtol=1e-4, atol=1e-6, msg=name)
