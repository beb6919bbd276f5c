"""model.llm.fused_qkv: a frozen attention's q, k and v projections as one stacked product. The same
outputs and input gradients as the stock projections up to the matrix kernel's rounding (through
Qwen2 decoder layers, with LoRA on top, and a SpeechLLM training step), 4 operators fewer per layer,
and the stock product wherever the call is not the plain one."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from west.bench.op_counter import OpCounter
from west.models.fused_qkv import fuse_qkv, is_fused

from helpers.speech import packed_batch, samples, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _llm(dtype=torch.float32, seed=0, bias=True):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg)
    if not bias:
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, name).bias = None
    return model.to(dtype).requires_grad_(False)


def _run(model, x):
    x = x.detach().requires_grad_(True)
    h = model.model(inputs_embeds=x, use_cache=False).last_hidden_state
    (h.float() * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
    return h.detach(), x.grad


@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_decoder_layers_give_the_same_outputs_and_gradients(dtype, bias):
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    h0, g0 = _run(_llm(dtype, bias=bias), x)
    model = _llm(dtype, bias=bias)
    assert fuse_qkv(model) == 3 and all(is_fused(layer.self_attn) for layer in model.model.layers)
    h1, g1 = _run(model, x)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h1, h0, **tol)
    torch.testing.assert_close(g1, g0, **tol)
    assert torch.equal(h1, _run(model, x)[0])   # the second call reuses the stacked weights: same result


def test_fewer_operators_per_layer():
    """Per layer, views left out (they launch nothing): 2 products fewer in the forward; in the backward
    2 products and the 2 sums that joined the three input gradients fewer, for one concatenation of
    the slices' gradients."""
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(1))

    def launches(model):
        _run(model, x)   # warm: the stacked weights are made on the first call
        with OpCounter() as c:
            with c.phase("forward"):
                _run(model, x)
        return {p: sum(c.counts[p].values()) - c.views[p] for p in ("forward", "backward")}, c.counts

    (stock, stock_ops), model = launches(_llm()), _llm()
    fuse_qkv(model)
    fused, fused_ops = launches(model)
    layers = model.config.num_hidden_layers
    assert stock["forward"] - fused["forward"] == 2 * layers, (stock, fused)
    assert stock["backward"] - fused["backward"] == 3 * layers, (stock, fused)
    assert stock_ops["forward"]["aten.addmm"] - fused_ops["forward"]["aten.addmm"] == 2 * layers
    assert stock_ops["backward"]["aten.mm"] - fused_ops["backward"]["aten.mm"] == 2 * layers
    assert fused_ops["backward"]["aten.cat"] - stock_ops["backward"]["aten.cat"] == layers


def test_weights_changed_after_fusing_are_stacked_again():
    x = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(2))
    model = _llm()
    fuse_qkv(model)
    _run(model, x)
    other = _llm(seed=5)
    model.load_state_dict(other.state_dict())   # copies in place: the weights' versions change
    torch.testing.assert_close(_run(model, x)[0], _run(other, x)[0], rtol=1e-5, atol=1e-6)


def test_other_calls_take_the_stock_product(monkeypatch):
    model = _llm()
    fuse_qkv(model)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(5, 32), torch.randn(5, 32)
    stock = lambda m, t: torch.nn.functional.linear(t, m.weight, m.bias)   # noqa: E731
    attn.q_proj(x)
    assert torch.equal(attn.k_proj(y), stock(attn.k_proj, y))            # another input: its own product
    torch.testing.assert_close(attn.v_proj(x), stock(attn.v_proj, x))    # the parked value
    assert torch.equal(attn.v_proj(x), stock(attn.v_proj, x))            # handed out once: then its own
    attn.q_proj(x)
    x.add_(1.0)                                                          # changed in place after q_proj
    assert torch.equal(attn.k_proj(x), stock(attn.k_proj, x))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # traced: stock products, nothing parked
    attn.q_proj(x)
    assert all(p is None for p in attn.q_proj._west_stack.parked)


def test_inference_mode_runs_the_stacked_product():
    """Inference tensors keep no version count (reading one raises): the parked columns still match."""
    x = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(6))
    stock, model = _llm(), _llm()
    fuse_qkv(model)
    with torch.inference_mode():
        h0 = stock.model(inputs_embeds=x, use_cache=False).last_hidden_state
        h1 = model.model(inputs_embeds=x, use_cache=False).last_hidden_state
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-6)


def test_trainable_projections_are_refused():
    model = _llm().requires_grad_(True)
    with pytest.raises(ValueError, match="model.llm.fused_qkv: model.layers.0.self_attn's projections train"):
        fuse_qkv(model)


def test_lora_on_stacked_projections_trains_the_same_adapters():
    from west.models.config import LoraSettings
    from west.models.llm import apply_lora

    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))

    def run(fused):
        model = _llm()
        if fused:
            fuse_qkv(model)
        torch.manual_seed(1)
        peft = apply_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "k_proj",
                                                                                          "v_proj"]))
        for n, p in peft.named_parameters():   # B starts at zero: give the adapters a say
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(hash(n) % 1000))
        h = peft.base_model.model.model(inputs_embeds=x, use_cache=False).last_hidden_state
        h.square().mean().backward()
        return h.detach(), {n: p.grad for n, p in peft.named_parameters() if p.grad is not None}

    (h0, g0), (h1, g1) = run(False), run(True)
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g0.keys() and len(g0) == 3 * 2 * 3
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6)


def test_a_speech_llm_step_is_unchanged():
    from west.models.speech_llm import SpeechLLM

    batch = packed_batch(samples(), 400)

    def step(fused):
        cfg = tiny_config()
        cfg.llm.dtype = "bfloat16"
        cfg.llm.fused_qkv, cfg.freeze_llm = fused, True
        torch.manual_seed(0)
        model = SpeechLLM(cfg).eval()
        assert all(is_fused(m) == fused for m in model.llm.modules() if type(m).__name__ == "Qwen2Attention")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(batch)
        out["loss_sum"].backward()
        return out["loss_sum"].item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (loss0, grads0), (loss1, grads1) = step(False), step(True)
    assert loss1 == pytest.approx(loss0, rel=1e-2) and grads1.keys() == grads0.keys()
    for n in grads0:
        torch.testing.assert_close(grads1[n].float(), grads0[n].float(), rtol=5e-2, atol=5e-3)

