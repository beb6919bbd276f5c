"""model.llm.fused_norm: stock RMSNorms run as one torch.rms_norm call each, with the stock module's
values and gradients (bit for bit on the CPU, where torch runs the same operators), other norms
untouched, and the whole speech LLM's loss and gradients unchanged."""
import copy
import importlib

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from west.models.fused_norm import STOCK_RMS_NORMS, fuse_rms_norms, is_fused

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODULES = {"Qwen2RMSNorm": "qwen2", "Qwen3RMSNorm": "qwen3", "Qwen2MoeRMSNorm": "qwen2_moe",
           "LlamaRMSNorm": "llama", "MistralRMSNorm": "mistral", "Qwen2_5OmniRMSNorm": "qwen2_5_omni"}


def _stock_class(name: str):
    module = importlib.import_module(f"transformers.models.{MODULES[name]}.modeling_{MODULES[name]}")
    return getattr(module, name)


class RmsNormCalls(TorchFunctionMode):
    """Counts torch.rms_norm calls (the function the fused route goes through) and those made
    under autocast, which on CUDA would run them in float32 (its fp32 list)."""

    def __init__(self):
        super().__init__()
        self.calls = self.under_autocast = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.rms_norm, torch.nn.functional.rms_norm):
            self.calls += 1
            self.under_autocast += torch.is_autocast_enabled(args[0].device.type)
        return func(*args, **(kwargs or {}))


def test_every_listed_class_is_known():
    assert set(STOCK_RMS_NORMS) == set(MODULES)


@pytest.mark.parametrize("name", STOCK_RMS_NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_equals_the_stock_forward_and_backward(name, dtype):
    g = torch.Generator().manual_seed(0)
    stock = _stock_class(name)(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        stock.weight.copy_(1 + 0.3 * torch.randn(48, generator=g))
    fused = copy.deepcopy(stock)
    assert fuse_rms_norms(fused) == 1 and is_fused(fused) and not is_fused(stock)
    x = (3 * torch.randn(2, 7, 48, generator=g)).to(dtype)
    dy = torch.randn(2, 7, 48, generator=g).to(dtype)
    outs, grads = [], []
    for norm in (stock, fused):
        xi = x.clone().requires_grad_(True)
        with RmsNormCalls() as calls:
            y = norm(xi)
        (y * dy).sum().backward()
        outs.append(y.detach())
        grads.append((xi.grad, norm.weight.grad))
        assert calls.calls == (1 if norm is fused else 0)
    assert outs[1].dtype == outs[0].dtype == dtype
    assert torch.equal(outs[1], outs[0])
    assert torch.equal(grads[1][0], grads[0][0]) and torch.equal(grads[1][1], grads[0][1])


def test_other_norms_keep_their_forward():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # 1 + weight: not the stock formula

    model = nn.Sequential(GemmaRMSNorm(16), nn.LayerNorm(16))
    assert fuse_rms_norms(model) == 0 and not any(is_fused(m) for m in model.modules())


def _tiny_qwen2(layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50)
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def test_every_norm_of_a_qwen2_is_fused_and_its_logits_are_unchanged():
    stock = _tiny_qwen2(layers=3)
    fused = copy.deepcopy(stock)
    assert fuse_rms_norms(fused) == 2 * 3 + 1          # two per decoder layer and the final norm
    assert list(fused.state_dict()) == list(stock.state_dict())
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with RmsNormCalls() as calls:
        got = fused(input_ids=ids).logits
    assert calls.calls == 7
    assert torch.equal(got, stock(input_ids=ids).logits)


def test_the_norm_runs_outside_autocast_and_keeps_the_stock_dtype():
    """Under autocast the stock module returns its input's dtype; so does the fused one, whose
    torch.rms_norm call runs with autocast off (CUDA's autocast would make it float32)."""
    stock = _tiny_qwen2(layers=1).float()          # an fp32 LLM under bf16 autocast, and a bf16 one
    fused = copy.deepcopy(stock)
    fuse_rms_norms(fused)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float32, torch.bfloat16):
        outs = []
        for model in (stock.to(dtype), fused.to(dtype)):
            norm = model.model.layers[0].input_layernorm
            x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
            with torch.autocast("cpu", dtype=torch.bfloat16), RmsNormCalls() as calls:
                outs.append((norm(x), model(input_ids=ids).logits))
            assert calls.under_autocast == 0 and calls.calls == (1 + 3 if model is fused else 0)   # the norm, then the model's 3
        assert outs[1][0].dtype == outs[0][0].dtype == dtype
        assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1])


@pytest.mark.parametrize("fused", [True, False])
def test_speech_llm_loss_and_gradients_do_not_change(fused):
    """The config key, through SpeechLLM: the same loss and gradients with the key on and off."""
    from west.models.speech_llm import SpeechLLM

    from helpers.speech import make_sample, packed_batch, tiny_config

    def build(on: bool):
        cfg = tiny_config()
        cfg.llm.fused_norm = on
        torch.manual_seed(0)
        return SpeechLLM(cfg).train()

    reference, model = build(False), build(fused)
    norms = [m for m in model.llm.modules() if type(m).__name__ in STOCK_RMS_NORMS]
    assert norms and all(is_fused(m) == fused for m in norms)
    g = torch.Generator().manual_seed(2)
    samples = [make_sample([("text", [5, 6]), ("speech", torch.randn(n, 80, generator=g)), ("answer", [7, 8, 9])])
               for n in (50, 73)]
    batch = packed_batch(samples, sum(len(s.ids) for s in samples) + 2)
    results = []
    for m in (reference, model):
        out = m(batch)
        out["loss_sum"].backward()
        results.append((out["loss_sum"].detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert torch.equal(results[1][0], results[0][0])
    assert results[1][1].keys() == results[0][1].keys()
    for n, want in results[0][1].items():
        assert torch.equal(results[1][1][n], want), n
