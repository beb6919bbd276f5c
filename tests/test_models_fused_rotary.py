"""model.llm.fused_rotary: q and k's rotary embedding as one autograd node. The same outputs and
gradients as the stock formula bit for bit (alone, through Qwen2 decoder layers in bf16 and
float32, and through a SpeechLLM training step), fewer dispatched operators, and the stock code
wherever the call is not the plain one or a module's formula is not the stock one."""
from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2 import modeling_qwen2

from west.bench.op_counter import OpCounter
from west.models.fused_rotary import PATCHED, fuse_rotary, make_fused, matches_stock

from helpers.speech import packed_batch, samples, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def stock_rotary():
    """Qwen2's own apply_rotary_pos_emb back after the test (the patch is for the process)."""
    fn = modeling_qwen2.apply_rotary_pos_emb
    stock = getattr(fn, PATCHED, fn)
    modeling_qwen2.apply_rotary_pos_emb = stock
    yield stock
    modeling_qwen2.apply_rotary_pos_emb = stock


def _llm(dtype, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).to(dtype).requires_grad_(False)


def _run(model, x):
    x = x.detach().requires_grad_(True)
    h = model.model(inputs_embeds=x, use_cache=False).last_hidden_state
    (h.float() * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
    return h.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decoder_layers_give_the_same_bits(stock_rotary, dtype):
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    h0, g0 = _run(_llm(dtype), x)
    model = _llm(dtype)
    assert fuse_rotary(model) == [modeling_qwen2.__name__]
    assert hasattr(modeling_qwen2.apply_rotary_pos_emb, PATCHED)
    h1, g1 = _run(model, x)
    assert torch.equal(h1, h0) and torch.equal(g1, g0)
    assert fuse_rotary(model) == [modeling_qwen2.__name__]          # once: not wrapped twice
    assert getattr(modeling_qwen2.apply_rotary_pos_emb, PATCHED) is stock_rotary


def test_fewer_operators_per_layer(stock_rotary):
    """Per decoder layer: 2 fewer in the forward (the negations) and 8 fewer in the backward (the
    negations, the zero-filled slice gradients and the sums joining them); 4 more per forward
    (sin·sign, made once for all layers)."""
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def count(model):
        _run(model, x)   # warm: sin·sign is made once per forward, not per layer
        with OpCounter() as c:
            _run(model, x)
        return c.totals()

    stock = count(_llm(torch.bfloat16))
    model = _llm(torch.bfloat16)
    fuse_rotary(model)
    fused = count(model)
    layers = model.config.num_hidden_layers
    assert stock["total"] - fused["total"] == 10 * layers - 4, (stock, fused)
    assert stock["backward"] - fused["backward"] == 8 * layers


def test_a_speech_llm_step_is_unchanged(stock_rotary, monkeypatch):
    """A bf16 LLM, as the seed config runs it (an fp32 LLM under autocast mixes dtypes in q·cos,
    which the stock code handles, and gets it)."""
    from west.models import fused_rotary
    from west.models.speech_llm import SpeechLLM

    batch = packed_batch(samples(), 400)
    calls = []
    apply = fused_rotary._Rotary.apply
    monkeypatch.setattr(fused_rotary._Rotary, "apply", lambda *a: calls.append(1) or apply(*a))

    def step(fused):
        cfg = tiny_config()
        cfg.llm.dtype = "bfloat16"
        torch.manual_seed(0)
        model = SpeechLLM(cfg).eval()
        if fused:
            assert fuse_rotary(model.llm)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(batch)
        out["loss_sum"].backward()
        return out["loss_sum"].item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss0, grads0 = step(False)
    assert calls == []
    loss1, grads1 = step(True)
    assert len(calls) == 2                                     # both decoder layers took the fused path
    assert loss1 == loss0 and grads1.keys() == grads0.keys()
    assert all(torch.equal(grads1[n], grads0[n]) for n in grads0)


def test_other_calls_and_formulas_keep_the_stock_code(stock_rotary):
    calls = []

    def spy(q, k, cos, sin, *args, **kwargs):
        calls.append((args, tuple(kwargs)))
        return stock_rotary(q, k, cos, sin, *args, **kwargs)

    fused = make_fused(spy)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    fused(q, k, cos, sin)
    fused(q, k, cos, sin, unsqueeze_dim=1)
    assert calls == []                                              # the plain call: fused
    fused(q.double(), k.double(), cos, sin)                         # mixed dtypes
    fused(q, k, cos.requires_grad_(True), sin)                      # a gradient through cos
    fused(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])       # odd width
    assert len(calls) == 3

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):               # another formula: pairs (2i, 2i+1)
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        rot = lambda t: torch.stack([-t[..., 1::2], t[..., ::2]], -1).flatten(-2)  # noqa: E731
        return q * c + rot(q) * s, k * c + rot(k) * s

    assert matches_stock(stock_rotary) and not matches_stock(interleaved)
    fake = types.ModuleType("fake_modeling")
    fake.apply_rotary_pos_emb = interleaved

    class FakeAttention(torch.nn.Module):
        pass

    FakeAttention.__module__ = fake.__name__
    sys.modules[fake.__name__] = fake
    try:
        assert fuse_rotary(torch.nn.Sequential(FakeAttention())) == []
        assert fake.apply_rotary_pos_emb is interleaved
    finally:
        del sys.modules[fake.__name__]


def test_decoder_layers_run_in_inference_mode(stock_rotary):
    """Inference tensors keep no version count (reading one raised in the signed sine's cache)."""
    x = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(5))
    stock, model = _llm(torch.float32), _llm(torch.float32)
    fuse_rotary(model)
    with torch.inference_mode():
        h0 = stock.model(inputs_embeds=x, use_cache=False).last_hidden_state
        h1 = model.model(inputs_embeds=x, use_cache=False).last_hidden_state
    assert torch.equal(h1, h0)
