"""west's packed attention on tiny random models of every architecture it claims (built from their
configs, weights large enough that softcapping, windows and sinks change the result): a packed
step equals the unpacked step of transformers' own eager attention, the unpacked path equals
transformers' own attention, and settings west cannot compute are refused when the model is set
up, naming the setting."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from west.hf import PackedCollator, use_packed_attention
from west.hf.support import EXACT

from helpers.hf_archs import ARCHS, PAD, VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LENGTHS = (11, 17, 9, 14)   # longer than the short windows (6), far shorter than the long one (4096)


def samples(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(2, VOCAB, (n,), generator=g).tolist()} for n in LENGTHS]


def padded(feats: list[dict]) -> dict:
    width = max(len(f["input_ids"]) for f in feats)
    ids = torch.full((len(feats), width), PAD)
    mask = torch.zeros((len(feats), width), dtype=torch.long)
    for r, f in enumerate(feats):
        ids[r, :len(f["input_ids"])], mask[r, :len(f["input_ids"])] = torch.tensor(f["input_ids"]), 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def token_loss(model, batch: dict) -> torch.Tensor:
    """Summed next-token loss (the same arithmetic for both layouts; the model's own count aside)."""
    labels = batch["labels"]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_step_equals_the_unpacked_step(arch):
    feats = samples()
    ref = tiny_model(arch).train()   # transformers' eager attention: the reference arithmetic
    ref_loss = token_loss(ref, padded(feats))
    ref_loss.backward()
    packed = use_packed_attention(tiny_model(arch)).train()
    got_loss = token_loss(packed, PackedCollator(PAD)(feats))
    got_loss.backward()
    assert got_loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for (name, p_ref), p in zip(ref.named_parameters(), packed.parameters()):
        assert p.grad is not None or p_ref.grad is None, f"{name} got no gradient packed"
        if p_ref.grad is not None:
            scale = float(p_ref.grad.abs().max())
            assert torch.allclose(p.grad, p_ref.grad, rtol=1e-4, atol=1e-4 * scale + 1e-9), name


@pytest.mark.parametrize("arch", list(ARCHS))
def test_unpacked_path_equals_transformers_own_attention(arch):
    feats = samples(1)
    ref, west = tiny_model(arch), use_packed_attention(tiny_model(arch))
    batch = padded(feats)
    del batch["labels"]
    alone = torch.tensor([feats[1]["input_ids"]])   # no mask at all: the causal (and window) mask is built
    with torch.no_grad():
        for inputs in (batch, {"input_ids": alone}):
            want, got = ref(**inputs).logits, west(**inputs).logits
            real = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
            assert torch.allclose(got[real], want[real], atol=1e-5, rtol=1e-5)


def _without(arch: str, model):
    """The same model with its softcap / window / sinks switched off."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if arch == "gemma2_full_softcap" and hasattr(module, "attn_logit_softcapping"):
            module.attn_logit_softcapping = None
        if arch in ("gemma2", "gemma3") and getattr(module, "sliding_window", None):
            module.sliding_window = 4096   # longer than every sample: no window
        if arch == "gpt_oss" and hasattr(module, "sinks"):
            module.sinks.data.fill_(-1e4)   # a sink without probability mass is no sink
    if arch in ("gemma2", "gemma3", "mistral_short_window", "phi3"):
        model.config.sliding_window = 4096
    return model


@pytest.mark.parametrize("arch", ["gemma2", "gemma2_full_softcap", "gemma3", "mistral_short_window", "phi3", "gpt_oss"])
def test_the_weights_make_softcap_windows_and_sinks_matter(arch):
    """Without this the equality tests above could pass with the setting ignored."""
    model = tiny_model(arch)
    batch = padded(samples())
    with torch.no_grad():
        a, b = token_loss(model, batch), token_loss(_without(arch, model), batch)
    assert abs(a - b) > 1e-3 * abs(a)


def _llama(**kw):
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, **kw))


@pytest.mark.parametrize("setting, kw", [
    ("attention_chunk_size", dict(attention_chunk_size=8)),
    ("use_bidirectional_attention", dict(use_bidirectional_attention=True)),
    ("layer_types", dict(layer_types=["linear_attention"])),
    ("alibi", dict(alibi=True)),
])
def test_settings_west_cannot_compute_are_refused_at_setup(setting, kw):
    model = _llama(**kw)
    with pytest.raises(ValueError, match=setting):
        use_packed_attention(model)


def test_a_model_that_bypasses_the_attention_interface_is_refused():
    model = _llama()
    type(model)._supports_attention_backend   # the class attribute the check reads
    model._supports_attention_backend = False
    with pytest.raises(ValueError, match="AttentionInterface"):
        use_packed_attention(model)


def test_an_untested_model_type_warns():
    model = _llama()
    model.config.model_type = "somebody_elses_llama"
    with pytest.warns(UserWarning, match="somebody_elses_llama"):
        use_packed_attention(model)


def test_every_architecture_tested_here_is_listed_as_exact():
    assert {tiny_model(a).config.model_type for a in ("llama", "gemma3", "gpt_oss")} <= set(EXACT)
    assert {ARCHS[a]().model_type for a in ARCHS} == set(EXACT)


def _docs_table() -> dict[str, str]:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "packing.md").read_text()
    table = text.split("<!-- architectures: checked by tests/test_hf_archs.py -->")[1].split("\n\n")[0]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
    return {first.strip(): status.strip() for first, status in rows}


def test_the_docs_table_lists_what_is_exact_and_what_is_refused():
    table = _docs_table()
    assert {t.strip("`") for t, status in table.items() if status == "exact"} == set(EXACT)
    refused = " ".join(t for t, status in table.items() if status == "refused")
    for setting in ("attention_chunk_size", "use_bidirectional_attention", "layer_types", "alibi",
                    "is_encoder_decoder", "_supports_attention_backend"):
        assert setting in refused, setting
