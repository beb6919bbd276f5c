"""A training step queues its work without waiting for the device.

On a GPU every read of a device value (``int(t)``, ``.item()``, ``.tolist()``, ``bool(t)``,
``nonzero`` or a boolean-mask index) stalls the host until the GPU catches up; a copy of a
pageable host tensor does the same. The step allows one read, at its end. Here the model
runs on the ``meta`` device, where any such read raises: a forward and backward that
complete on meta read nothing back. The CUDA LLM kernel (torch's varlen attention) is
replaced by a shape-only stand-in; everything around it is the production code.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import west.models.conformer as conformer
import west.models.varlen_kernels as kernels
from west.models.attention import SegmentPlan
from west.models.speech_llm import SpeechLLM
from west.train.step import plan_step, queue_step

from helpers.speech import packed_batch, padded_batch, samples, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def varlen_stub(q, k, v, cu_q, cu_k, max_q, max_k, window_size=None, scale=None, enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's shape, differentiable in q, k and v."""
    return q * 1.0 + (k.float().sum() + v.float().sum()).to(q.dtype) * 0.0


class HostCopies(TorchDispatchMode):
    """Counts tensors copied from the CPU to the meta device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu" \
                and torch.device(kwargs.get("device") or "cpu").type == "meta":
            self.count += 1
        if func is torch.ops.aten.copy_.default and args[1].device.type == "cpu" and args[0].device.type == "meta":
            self.count += 1
        return func(*args, **kwargs)


def meta_model(depth: int, llm_backend: str, monkeypatch, pos_enc: str = "relative",
               checkpoint_scope: str | None = None) -> SpeechLLM:
    monkeypatch.setattr(kernels, "_torch_varlen_kernel", lambda: varlen_stub)
    # what auto picks on CUDA in bf16 without flash-attn: pos_enc wenet's packed rows take the kernel too
    monkeypatch.setattr(conformer, "auto_backend", lambda device, dtype, dropout: "torch_varlen")
    cfg = tiny_config()
    cfg.llm.config["num_hidden_layers"] = depth
    cfg.llm.attn_backend = llm_backend
    cfg.encoder.num_blocks = depth
    cfg.encoder.pos_enc = pos_enc
    if checkpoint_scope is not None:   # seed_gpu.yaml's frozen LLM, checkpointed
        cfg.freeze_llm, cfg.llm.gradient_checkpointing, cfg.llm.checkpoint_scope = True, True, checkpoint_scope
    with torch.device("meta"):
        return SpeechLLM(cfg)


def batches():
    ss = samples()
    width = sum(len(s.ids) for s in ss) + 5
    return {"pack": packed_batch(ss, width), "pack_encoder_padded": packed_batch(ss, width, encoder="padded"),
            "padded": padded_batch(ss)}


@pytest.mark.parametrize("llm_backend,pos_enc", [("torch_varlen", "relative"), ("sdpa_segments", "relative"),
                                                 ("torch_varlen", "wenet")])   # packed Conformer on the kernel
@pytest.mark.parametrize("mode", ["pack", "pack_encoder_padded", "padded"])
def test_forward_and_backward_read_nothing_back(mode, llm_backend, pos_enc, monkeypatch):
    """Completes on meta (no read), and the host-built index tensors are made once per batch:
    their copies do not grow with the number of layers."""
    copies = []
    for depth in (2, 4):
        model = meta_model(depth, llm_backend, monkeypatch, pos_enc)
        with HostCopies() as seen:
            out = model(batches()[mode].to("meta"))
            out["loss_sum"].backward()
        assert out["loss_sum"].device.type == "meta" and out["n_correct"].device.type == "meta"
        assert isinstance(out["n_tokens"], int) and out["n_tokens"] > 0
        assert all(p.grad is not None for p in model.encoder.parameters() if p.requires_grad)
        copies.append(seen.count)
    assert copies[0] == copies[1], f"host->device copies grow with depth: {copies}"


@pytest.mark.parametrize("scope", ["layer", "mlp"])
def test_checkpointed_frozen_llm_reads_nothing_back(scope, monkeypatch):
    """seed_gpu.yaml's LLM: frozen, its MLPs (or whole layers) recomputed in the backward."""
    model = meta_model(2, "torch_varlen", monkeypatch, "wenet", checkpoint_scope=scope)
    out = model(batches()["pack"].to("meta"))
    out["loss_sum"].backward()
    assert all(p.grad is not None for p in model.encoder.parameters())
    assert all(p.grad is None for p in model.llm.parameters())


def test_queue_step_reads_nothing_back(monkeypatch):
    """Accumulation over micro-batches, clipping and the step's figures: all queued."""
    model = meta_model(2, "torch_varlen", monkeypatch)
    b = batches()
    micro = [b["pack"], b["padded"]]
    values = queue_step(model, micro, plan_step(micro, 2), device=torch.device("meta"), world_size=1,
                        grad_clip=1.0)
    assert values.device.type == "meta" and values.dim() == 1


def test_meta_catches_a_read():
    """The method works: building a plan from a device copy of the boundaries reads them, and fails."""
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    SegmentPlan.from_cu_seqlens(cu, device="meta")          # host copy: fine
    with pytest.raises((RuntimeError, NotImplementedError)):
        SegmentPlan.from_cu_seqlens(cu.to("meta"))
