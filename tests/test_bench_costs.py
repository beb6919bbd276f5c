"""west.bench.costs: the step-time fit, and the FLOP count the benchmark's MFU and speed-up predictions
rest on (SDPA with GQA, checkpointing's replay counted apart, cu_seqlens kernels counted as segment
SDPA, a count that fits where the step fits)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from west.bench.costs import sdpa_flops, step_time_fit


def test_step_time_fit_recovers_a_line_and_refuses_too_little():
    tokens = [1000, 4000, 8000, 8000]
    exact = step_time_fit([0.1 + 2e-5 * t for t in tokens], tokens)
    assert exact == pytest.approx({"fixed_s": 0.1, "per_token_s": 2e-5, "steps": 4})
    noisy = step_time_fit([0.12, 0.18, 0.25, 0.27], [1000, 4000, 8000, 8000])
    assert noisy["fixed_s"] == pytest.approx(0.1, abs=0.02) and noisy["per_token_s"] > 0
    assert step_time_fit([0.2, 0.3], [1000, 2000]) is None             # two steps: nothing to check a line by
    assert step_time_fit([0.2, 0.3, 0.25], [8000, 8000, 8000]) is None  # one size: no slope
    assert step_time_fit([0.40, 0.39, 0.41], [14326, 14600, 14720]) is None   # full batches of one budget
    with pytest.raises(ValueError, match="3 step times for 2 batches"):
        step_time_fit([0.1, 0.2, 0.3], [1, 2])


def test_sdpa_flop_formula_with_gqa():
    from torch.utils.flop_counter import FlopCounterMode

    b, h, hkv, n, d = 2, 4, 2, 10, 8
    q = torch.randn(b, h, n, d, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, d, requires_grad=True) for _ in range(2))
    with FlopCounterMode(display=False, custom_mapping=sdpa_flops()) as fc:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    fwd = 4 * b * h * n * n * d   # QK^T and PV
    assert fc.get_total_flops() == fwd + 2.5 * fwd   # backward: recomputed scores + 4 matmuls


@pytest.mark.parametrize("layers", [None, 1, "encoder", "mlp"])
def test_checkpointing_replay_is_counted_apart(layers):
    """Executed FLOPs include activation checkpointing's replay; ``replay`` is exactly that share
    (the checkpointed layers' forward; under checkpoint_scope mlp the frozen MLPs' gate and up
    products), so executed less replay is the step without checkpointing: what MFU counts as useful work."""
    from west.bench.costs import count_flops
    from west.models.speech_llm import SpeechLLM

    from helpers.speech import packed_batch, samples, tiny_config

    ss = samples()
    batch = packed_batch(ss, sum(len(s.ids) for s in ss) + 4)
    counts = []
    for on in (False, True):
        cfg = tiny_config()
        if layers == "encoder":
            cfg.encoder.gradient_checkpointing = on
        elif layers == "mlp":
            cfg.freeze_llm, cfg.llm.gradient_checkpointing, cfg.llm.checkpoint_scope = True, on, "mlp"
        else:
            cfg.llm.gradient_checkpointing, cfg.llm.checkpoint_layers = on, layers if on else None
        torch.manual_seed(0)
        counts.append(count_flops(SpeechLLM(cfg), [batch], torch.device("cpu")))
    plain, ckpt = counts
    assert plain["replay"] == 0 and ckpt["replay"] > 0
    assert ckpt["forward"] == plain["forward"]
    assert ckpt["backward"] - ckpt["replay"] == plain["backward"]
    assert ckpt["total"] - ckpt["replay"] == plain["total"]
    if layers == "mlp":   # two of each MLP's three products: 2 x (one product's FLOPs) per layer
        from transformers import Qwen2Config

        c = Qwen2Config(**tiny_config().llm.config)
        rows = batch.input_ids.numel()
        assert ckpt["replay"] == c.num_hidden_layers * 2 * (2 * rows * c.hidden_size * c.intermediate_size)
    if layers == 1:   # one of the two decoder layers: half of what all of them replay
        cfg = tiny_config()
        cfg.llm.gradient_checkpointing = True
        torch.manual_seed(0)
        assert 2 * ckpt["replay"] == count_flops(SpeechLLM(cfg), [batch], torch.device("cpu"))["replay"]


def test_flops_of_the_conformers_varlen_route_are_counted_as_segment_sdpa():
    """The flop counter cannot see into cu_seqlens kernels: a Conformer whose attention runs one
    (pos_enc wenet) is counted on segment SDPA, as packed LLM attention is, and keeps its backend."""
    from west.bench.costs import count_flops
    from west.models.speech_llm import SpeechLLM

    from helpers.speech import packed_batch, samples, tiny_config

    ss = samples()
    batch = packed_batch(ss, sum(len(s.ids) for s in ss) + 4)
    counts = {}
    for backend in ("varlen", "sdpa_segments"):
        cfg = tiny_config()
        cfg.encoder.pos_enc, cfg.encoder.attn_backend = "wenet", backend
        torch.manual_seed(0)
        model = SpeechLLM(cfg)
        counts[backend] = count_flops(model, [batch], torch.device("cpu"))
        assert {b.attn.backend for b in model.encoder.blocks} == {backend}
    assert counts["varlen"] == counts["sdpa_segments"]


def test_flop_count_holds_no_more_memory_than_the_step_it_counts():
    """Counting a batch's FLOPs is the benchmark's warm-up at the timed size, so it must fit where
    the step fits: with the LLM's layers checkpointed, its peak of live tensor bytes is the plain
    step's (torch's FlopCounterMode in the backward kept the replayed layers alive: twice that here, and
    a 7B at pack 16,384 ran out of an H200). Its backward total is FlopCounterMode's."""
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from torch.utils.flop_counter import FlopCounterMode

    from west.bench.costs import count_flops, sdpa_flops
    from west.bench.memory import LiveTensorBytes, storage_bytes
    from west.models.speech_llm import SpeechLLM

    from helpers.speech import packed_batch, samples, tiny_config

    ss = samples() * 4
    batch = packed_batch(ss, sum(len(s.ids) for s in ss) + 4)
    cfg = tiny_config()
    cfg.llm.config.update(num_hidden_layers=6, hidden_size=128, intermediate_size=1024)
    cfg.llm.gradient_checkpointing = True
    torch.manual_seed(0)
    model = SpeechLLM(cfg).train()
    weights = storage_bytes([*model.parameters(), *model.buffers()])
    step = LiveTensorBytes(None, weights)
    with step:
        with set_checkpoint_early_stop(False):   # as count_flops replays: whole layers
            loss = model(batch)["loss_sum"]
        with FlopCounterMode(display=False, custom_mapping=sdpa_flops()) as torch_count:
            loss.backward()
    model.zero_grad(set_to_none=True)
    plain = LiveTensorBytes(None, weights)
    with plain:
        model(batch)["loss_sum"].backward()
    model.zero_grad(set_to_none=True)
    counting = LiveTensorBytes(None, weights)
    with counting:
        flops = count_flops(model, [batch], torch.device("cpu"))
    above = lambda tracker: tracker.peak - weights  # noqa: E731
    assert above(step) > 1.5 * above(plain)   # the old way, as the benchmark counted
    assert above(counting) <= 1.02 * above(plain)
    assert flops["backward"] == torch_count.get_total_flops() > 0
