"""train.bf16_weights: trainable Linear layers multiply with bf16 working copies of their float32
masters. Under bf16 autocast the training is the same bit for bit (losses, gradient norms,
updated weights; accumulation and LoRA included), the weight casts are gone from the step's
dispatched operators, a stale copy is never used, and west-train with it, stopped after a
checkpoint and resumed, matches a run without it."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from west.bench.op_counter import OpCounter
from west.models.working_weights import ATTR, WorkingWeights, uses_working_weights
from west.schema import ConfigError
from west.train.schedule import build_optimizer, build_scheduler
from west.train.step import autocast, plan_step, train_step, working_weights

from helpers.e2e import read_jsonl, tiny_encoder, tiny_llm, train_argv, write_lists
from helpers.speech import lora_model, packed_batch, padded_batch, samples, tiny_config, tiny_model
from helpers.threads import torch_threads

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")


def _train(model, steps, weights: bool, accum: int):
    """``steps`` optimizer steps of ``accum`` micro-batches each under bf16 autocast (clipped, fused
    AdamW as west-train builds it): per-step (loss, grad norm) and the final state dict."""
    ww = working_weights(model, weights)
    opt = build_optimizer(model, 1e-2, 0.01, (0.9, 0.999), 1e-8)
    sched = build_scheduler(opt, 1, len(steps), 0.0)
    out = []
    for micro in steps:
        micro = micro[:accum]
        res = train_step(model, micro, plan_step(micro, len(micro)), opt, sched, device=CPU, world_size=1,
                         grad_clip=0.5, precision="bf16", weights=ww)
        assert res.status == "ok"
        out.append((res.loss, res.grad_norm))
    return out, {k: v.clone() for k, v in model.state_dict().items()}, ww


def _steps(layout):
    s = samples()
    make = (lambda part: packed_batch(part, 200)) if layout == "pack" else padded_batch
    return [[make(s[:3]), make(s[3:])], [make(s[1:4]), make(s[:1] + s[4:])], [make(s[2:]), make(s[:2])]]


def _wenet_model():
    """WeNet's positional biases, which the Conformer casts itself (through west.models.working_weights.cast)."""
    from west.models.speech_llm import SpeechLLM

    cfg = tiny_config()
    cfg.encoder = tiny_encoder(dropout=0.0, buckets_per_octave=2, pos_enc="wenet")
    torch.manual_seed(0)
    return SpeechLLM(cfg).eval()


@pytest.mark.parametrize("kind", ["full", "lora", "wenet"])
@pytest.mark.parametrize("layout,accum", [("pack", 1), ("pack", 2), ("padded", 2)])
def test_training_equals_autocast_bit_for_bit(kind, layout, accum):
    build = {"full": tiny_model, "lora": lora_model, "wenet": _wenet_model}[kind]
    base, base_state, _ = _train(build(), _steps(layout), weights=False, accum=accum)
    model = build()
    ours, state, ww = _train(model, _steps(layout), weights=True, accum=accum)
    assert len(ww) > 0 and ours == base
    assert state.keys() == base_state.keys()
    assert all(state[k].dtype == base_state[k].dtype and torch.equal(state[k], base_state[k]) for k in state)
    routed = [n for n, m in model.named_modules() if uses_working_weights(m)]
    llm = [n for n in routed if n.startswith("llm.")]
    assert llm and any(n.startswith("encoder.") for n in routed)
    if kind == "lora":   # the adapters, not the frozen base projections they wrap
        assert all("lora_" in n for n in llm)


def _casts(model, batch, ww=None):
    counter = OpCounter()
    with counter, torch.autocast("cpu", dtype=torch.bfloat16):
        model(batch)["loss_sum"].backward()
    if ww is not None:
        ww.collect_grads()
    model.zero_grad(set_to_none=True)
    return counter.merged()["aten._to_copy"]


@pytest.mark.parametrize("pos_enc", ["relative", "wenet"])
def test_the_weight_casts_are_gone(pos_enc):
    """Two dispatched casts fewer per tensor used and step: autocast's (or the model's own, for
    WeNet's positional biases) in the forward, its gradient's in the backward (once the copies exist)."""
    build = tiny_model if pos_enc == "relative" else _wenet_model
    batch = packed_batch(samples(), 400)
    stock = _casts(build(), batch)
    model = build()
    ww = WorkingWeights(model)
    _casts(model, batch, ww)                 # the first forward makes the copies
    used = len(ww.used())   # the Linear and convolution layers' tensors, not the norms' or the LM head's
    assert used > 0 and stock - _casts(model, batch, ww) == 2 * used
    names = [n for n, p in model.named_parameters() if getattr(p, ATTR).tensor is not None]
    assert any(".depthwise." in n for n in names) and any("subsampling.conv." in n for n in names)
    assert any("pos_bias" in n for n in names) == (pos_enc == "wenet")   # relative adds them in float32


def test_a_backward_outside_the_step_leaks_nothing_into_the_next_pass():
    """The benchmark counts the encoder's operators with a backward of its own between timed
    passes: the copies' gradients it leaves are cleared, so each pass trains as from scratch."""
    from west.bench.op_counter import count_encoder_ops
    from west.bench.runner import PassRunner
    from west.train.config import TrainConfig

    batches = [packed_batch(samples()[:3], 200), packed_batch(samples()[3:], 200)]
    train = TrainConfig(precision="bf16", bf16_weights=True, grad_clip=0.5, warmup_steps=1)
    runner = PassRunner(tiny_model(), train, CPU, seed=0)

    def one_pass():
        opt, sched = runner.fresh(len(batches))
        return [runner.step(b, opt, sched).loss for b in batches]

    first = one_pass()
    count_encoder_ops(runner.model, batches, CPU, "bf16")
    assert all(c.tensor is None or c.tensor.grad is None for c in runner.weights.copies)
    for precision in ("bf16", "fp32"):   # gradients left on the copies, then on the masters
        with autocast(CPU, precision):
            x = runner.model.encoder.forward_flat(batches[0].feats, cu_seqlens=batches[0].host.feat_cu_seqlens)[0]
        x.float().sum().backward()
        assert one_pass() == first


def test_a_changed_master_is_never_used_stale():
    torch.manual_seed(0)
    ref, layer = nn.Linear(8, 4), nn.Linear(8, 4)
    ww = WorkingWeights(layer)
    x = torch.randn(3, 8)

    def both():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x), ref(x)

    a, b = both()
    assert not torch.equal(a, b)
    layer.load_state_dict(ref.state_dict())            # in place: the version counter moves
    a, b = both()
    assert torch.equal(a, b)
    new = torch.randn(4, 8)
    layer.weight.data = new.clone()                     # storage replaced: no version bump
    ref.weight.data = new.clone()
    a, b = both()
    assert torch.equal(a, b)
    with torch.no_grad():                                # what the optimizer's step is followed by
        layer.weight.add_(1.0)
        ref.weight.add_(1.0)
    ww.refresh()
    a, b = both()
    assert torch.equal(a, b)


def test_stock_forward_where_autocast_is_not_bf16_and_for_frozen_layers():
    torch.manual_seed(0)
    layer, frozen = nn.Linear(8, 4), nn.Linear(8, 4).requires_grad_(False)
    holder = nn.Sequential(layer, nn.Linear(4, 4).requires_grad_(False))
    ww = WorkingWeights(nn.ModuleList([holder, frozen]))
    assert len(ww) == 2 and not uses_working_weights(frozen) and not uses_working_weights(holder[1])
    x = torch.randn(3, 8)
    assert layer(x).dtype == torch.float32 and torch.equal(layer(x), x @ layer.weight.T + layer.bias)
    with torch.autocast("cpu", dtype=torch.float16):
        assert layer(x).dtype == torch.float16         # not bf16: autocast casts the masters as usual
    layer.requires_grad_(False)                        # frozen after routing: the stock forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and ww.copies[0].tensor is None


def test_refused_where_it_cannot_hold():
    from west.config import load_config

    from helpers.e2e import TINY_CPU

    with pytest.raises(ConfigError, match="train.bf16_weights: needs train.precision bf16"):
        load_config(str(TINY_CPU), [("train.bf16_weights", "true"), ("train.precision", "fp32")])
    with pytest.raises(ConfigError, match="train.bf16_weights: one process only"):
        working_weights(nn.Linear(2, 2), True, world_size=2)
    assert working_weights(nn.Linear(2, 2), False) is None


def test_west_train_with_it_resumed_matches_a_run_without_it(tmp_path, corpus, tmp_path_factory, capsys):
    """The same losses, gradient norms and checkpoint bytes as plain autocast, through west-train; the
    resumed run (weights loaded from step 2's checkpoint, copies made from them) ends the same."""
    from safetensors.torch import load_file

    from west.bin.train import main

    llm, lists = tiny_llm(tmp_path_factory), write_lists(corpus["rows"], tmp_path / "lists", 9)
    run = ["--batch_type", "pack", "--pack_tokens", "200", "--train.precision", "bf16", "--train.save_every", "2"]

    def train(out, on, steps):
        assert main(train_argv(llm, lists.jsonl, out, *run, "--max_steps", str(steps),
                               "--train.bf16_weights", on)) == 0

    with torch_threads():
        train(tmp_path / "plain", "false", 4)
        train(tmp_path / "ours", "true", 4)
        train(tmp_path / "resumed", "true", 2)
        train(tmp_path / "resumed", "true", 4)
    assert "train.bf16_weights: " in capsys.readouterr().out   # said at the start of the runs with it
    logs = {name: read_jsonl(tmp_path / name / "train_log.jsonl") for name in ("plain", "ours", "resumed")}
    assert [r["step"] for r in logs["resumed"]] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        plain = [r[key] for r in logs["plain"]]
        assert all(math.isfinite(v) for v in plain)
        assert [r[key] for r in logs["ours"]] == plain == [r[key] for r in logs["resumed"]], key
    ckpts = {name: load_file(tmp_path / name / "checkpoints" / "step_00000004" / "model.safetensors")
             for name in logs}
    assert all(v.dtype != torch.bfloat16 or k.startswith("llm.") for k, v in ckpts["ours"].items())
    for name in ("ours", "resumed"):
        assert ckpts[name].keys() == ckpts["plain"].keys()
        assert all(torch.equal(ckpts[name][k], ckpts["plain"][k]) for k in ckpts["plain"]), name
