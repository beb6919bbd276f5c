"""peft's cast of each adapted input to the float32 adapters is off under autocast (it only copies the
activation there) and on outside it, where a bf16 input must meet float32 adapters in float32
(west.models.llm.LoraInputCasts). With dropout 0 the step is the same bit for bit, with fewer copies."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from west.models.speech_llm import SpeechLLM

from helpers.speech import ALL_PROJ, lora_model, packed_batch, samples

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def bf16_lora_model() -> SpeechLLM:
    """The seed's setting in small: the base LLM in bf16, float32 adapters on every projection (random B)."""
    return lora_model(llm_dtype="bfloat16")


def step(model: SpeechLLM, batch, autocast: bool) -> tuple[torch.Tensor, dict, Counter]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), Ops() as ops:
        loss = model(batch)["loss_sum"]
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, ops.calls


def test_under_autocast_the_casts_are_off_and_the_step_is_the_same():
    batch = packed_batch(samples(), 256)
    model = bf16_lora_model()
    adapters = [n for n, p in model.named_parameters() if "lora_A" in n]
    assert adapters and all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    layers = model.lora_casts.layers
    assert len(layers) == len(adapters) == 2 * len(ALL_PROJ)

    model.lora_casts.match = lambda device_type: None   # peft's default: every input cast to float32
    ref_loss, ref_grads, ref_ops = step(model, batch, autocast=True)
    assert all(layer.cast_input_dtype_enabled for layer in layers)

    model = bf16_lora_model()
    loss, grads, ops = step(model, batch, autocast=True)
    assert not any(layer.cast_input_dtype_enabled for layer in model.lora_casts.layers)
    assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
    # per adapter, the input's copy to float32 and autocast's back in the forward, and their two in the backward
    assert ref_ops["_to_copy"] - ops["_to_copy"] == 4 * len(adapters), (ref_ops["_to_copy"], ops["_to_copy"])
    assert sum(ref_ops.values()) - sum(ops.values()) == 4 * len(adapters)


def test_outside_autocast_the_casts_are_on_again():
    batch = packed_batch(samples(), 256)
    model = bf16_lora_model()
    step(model, batch, autocast=True)
    assert not any(layer.cast_input_dtype_enabled for layer in model.lora_casts.layers)
    loss, grads, _ = step(model, batch, autocast=False)   # bf16 inputs meet float32 adapters: needs the casts
    assert all(layer.cast_input_dtype_enabled for layer in model.lora_casts.layers)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
