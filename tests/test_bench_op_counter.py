"""west.bench.op_counter: the dispatched-operator counter counts known modules exactly, by phase."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from west.bench.op_counter import OpCounter, count_encoder_ops, step_phases


def linear_counts(bias: bool, input_grad: bool = False) -> OpCounter:
    torch.manual_seed(0)
    lin = nn.Linear(4, 3, bias=bias)
    x = torch.randn(5, 4, requires_grad=input_grad)
    grad = torch.ones(5, 3)
    counter = OpCounter()
    with counter, counter.phase("forward"):
        y = lin(x)
    with counter:
        y.backward(grad)
    return counter


def test_bias_free_linear_counts_exactly():
    c = linear_counts(bias=False)
    # forward: y = x @ W.t()  ->  t(W), mm
    assert dict(c.counts["forward"]) == {"aten.t": 1, "aten.mm": 1}
    # backward (x needs no grad): MmBackward0 gives the grad of W.t() as (x.t() @ g) and returns it
    # transposed [t, mm, t]; TBackward0 transposes it back [t]; AccumulateGrad stores it [detach]
    assert dict(c.counts["backward"]) == {"aten.t": 3, "aten.mm": 1, "aten.detach": 1}
    assert c.totals() == {"forward": 2, "backward": 5, "optimizer": 0, "other": 0, "total": 7, "views": 5}
    assert c.merged() == {"aten.t": 4, "aten.mm": 2, "aten.detach": 1}


def test_counts_change_with_the_module():
    with_bias = linear_counts(bias=True)
    # the bias fuses into addmm; its gradient is a sum over rows viewed to (3,), stored by a second AccumulateGrad
    assert dict(with_bias.counts["forward"]) == {"aten.t": 1, "aten.addmm": 1}
    assert dict(with_bias.counts["backward"]) == {"aten.t": 3, "aten.mm": 1, "aten.sum": 1, "aten.view": 1,
                                                  "aten.detach": 2}
    input_grad = linear_counts(bias=False, input_grad=True)
    # the input's gradient adds g @ W (t, mm) and its own AccumulateGrad
    assert dict(input_grad.counts["backward"]) == {"aten.t": 4, "aten.mm": 2, "aten.detach": 2}


def test_step_phases_split_forward_backward_optimizer_and_the_rest():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3, bias=False)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, foreach=False)
    x = torch.randn(5, 4)
    c = OpCounter()
    with step_phases(c, lin, opt), c:
        loss = lin(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert dict(c.counts["forward"]) == {"aten.t": 1, "aten.mm": 1}
    # SumBackward0 expands the seed gradient; then the Linear's backward as above
    assert dict(c.counts["backward"]) == {"aten.expand": 1, "aten.t": 3, "aten.mm": 1, "aten.detach": 1}
    assert dict(c.counts["optimizer"]) == {"aten.add_": 1}          # SGD without momentum: p.add_(g, alpha=-lr)
    assert dict(c.counts["other"]) == {"aten.sum": 1, "aten.ones_like": 1}   # the loss and backward's seed
    # the hooks are gone afterwards: nothing is labelled outside the block
    c2 = OpCounter()
    with c2:
        lin(x)
    assert c2.totals()["forward"] == 0 and c2.totals()["other"] == 2
    with pytest.raises(ValueError, match="phase must be one of"):
        with c.phase("sideways"):
            pass


class LinearEncoder(nn.Module):
    """An encoder with SpeechLLM's contract (forward_flat) whose ops are known: one bias-free Linear."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3, bias=False)

    def forward_flat(self, feats, lengths=None, cu_seqlens=None):
        assert (lengths is None) != (cu_seqlens is None)
        return self.lin(feats), None


def fake_batch(packed: bool):
    feats = torch.randn(7, 4) if packed else torch.randn(2, 5, 4)
    b = SimpleNamespace(feats=feats, encoder_packed=packed, feat_cu_seqlens=torch.tensor([0, 3, 7]),
                        feat_lens=torch.tensor([5, 2]))
    b.to = lambda device: b
    b.encoder_inputs = lambda: {"cu_seqlens": b.feat_cu_seqlens} if packed else {"lengths": b.feat_lens}
    return b


def test_encoder_alone_counts_its_forward_and_backward_exactly():
    model = nn.Module()
    model.encoder = LinearEncoder()
    before = model.encoder.lin.weight.detach().clone()
    packed = count_encoder_ops(model, [fake_batch(True), fake_batch(True)], torch.device("cpu"))
    assert packed["steps"] == 2
    # per batch: the bias-free Linear on 2-D feats, forward and backward (weight gradient only)
    assert packed["per_step"] == {"forward": 2, "backward": 5, "optimizer": 0, "other": 0, "total": 7, "views": 5}
    padded = count_encoder_ops(model, [fake_batch(False)], torch.device("cpu"))
    # 3-D feats: the Linear flattens to 2-D and back (view, mm, _unsafe_view), and the backward views too
    assert padded["per_step"]["forward"] == packed["per_step"]["forward"] + 2
    assert padded["per_step"]["total"] > packed["per_step"]["total"]
    assert torch.equal(model.encoder.lin.weight, before) and model.encoder.lin.weight.grad is None


def test_seed_depth_config_is_the_seed_config_at_a_tiny_width():
    """conf/seed_depth_tiny.yaml (the op-count table of docs/benchmarks.md) keeps seed_gpu.yaml's
    depth and every setting that changes which operators run; only widths and devices differ."""
    import importlib.util
    from pathlib import Path

    import yaml

    conf = Path(__file__).resolve().parent.parent / "recipes" / "aishell" / "conf"
    seed, tiny = (yaml.safe_load((conf / name).read_text()) for name in ("seed_gpu.yaml", "seed_depth_tiny.yaml"))
    widths = {"d_model", "ffn_dim", "hidden_dim", "path"}
    for section in ("encoder", "projector", "llm"):
        a, b = seed["model"][section], tiny["model"][section]
        assert {k: v for k, v in a.items() if k not in widths} == {k: v for k, v in b.items() if k not in widths}
    for key in ("freeze_encoder", "freeze_llm"):
        assert seed["model"][key] == tiny["model"][key]
    assert seed["train"]["precision"] == tiny["train"]["precision"] == "bf16"
    for key in ("batch_type", "pack_tokens", "pack_algorithm", "encoder_layout"):
        assert seed["data"][key] == tiny["data"][key]
    tool_path = conf.parent.parent.parent / "tools" / "make_seed_llm.py"
    spec = importlib.util.spec_from_file_location("make_seed_llm", tool_path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.SHAPES["seed-depth-tiny"]["num_hidden_layers"] == tool.SHAPES["qwen2-1.5b"]["num_hidden_layers"] == 28
    assert seed["model"]["encoder"]["num_blocks"] == 12


def test_a_pack_step_dispatches_as_many_operators_whatever_the_utterances_it_holds(tmp_path, corpus, monkeypatch):
    """On the CUDA route (one cu_seqlens kernel call per attention layer, here flash-attn's CPU
    reference in its place) a pack step's launching operators do not grow with the utterances in a
    pack: the host's work per step is fixed, and a bigger pack only adds GPU work (what gpu_suite's
    part best_sizes leans on). A few operators come and go with the data (a projector group that
    needs zero fill); one per utterance anywhere in the step would add eight or more here."""
    import argparse

    import west.models.attention as attention
    from west.lab.tool_setup import tool_setup

    from helpers.e2e import bench_setup

    monkeypatch.setattr(attention, "auto_backend", lambda *args: "flash")   # the LLM's route on CUDA
    llm, conf = bench_setup(tmp_path, corpus["texts"].values())
    launching, utterances = [], []
    for pack in (256, 768):
        args = argparse.Namespace(config=str(conf), data=str(corpus["list"]), num_utts=len(corpus["texts"]),
                                  modes="pack", batch_size=4, max_tokens_in_batch=512, pack_tokens=pack, seed=0)
        setup = tool_setup(args, ["--model.llm.path", str(llm), "--model.encoder.pos_enc", "wenet",
                                  "--model.encoder.attn_backend", "varlen"], tmp_path / f"subset{pack}.list")
        runner, batches = setup.runner, setup.batches(setup.modes[0])
        opt, sched = runner.fresh(len(batches))
        for i, batch in enumerate(batches):
            counter = OpCounter()
            with step_phases(counter, runner.model, opt), counter:
                runner.step(batch, opt, sched)
            if i:   # the first step also creates the optimizer's state
                totals = counter.totals()
                launching.append(totals["total"] - totals["views"])
                utterances.append(len(batch.keys))
    assert max(utterances) - min(utterances) >= 8
    assert max(launching) - min(launching) <= 4, list(zip(utterances, launching))
