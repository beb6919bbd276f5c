"""train.cuda_graphs' model side: packed rows padded to one static shape compute the loss and
gradients of the unpadded row (padding in segments of its own, empty trailing segments), rows
that do not fit run unpadded and are counted, and the config refuses what one captured graph
cannot replay. The capture itself needs CUDA (tools/gpu_suite.sh, part graphs)."""
import pytest
import torch

from west.models.speech_llm import SpeechLLM
from west.models.static_decoder import StaticShape, padded_cu_seqlens, padding_positions

from helpers.speech import make_sample, packed_batch, tiny_config


def _cu(*bounds):
    return torch.tensor(bounds, dtype=torch.int32)


def test_padded_boundaries():
    shape = StaticShape(tokens=16, segments=6, max_seqlen=5)
    # 7 real tokens in 2 segments; 9 padding tokens in segments of at most 5; 2 empty slots
    assert padded_cu_seqlens(_cu(0, 3, 7), shape).tolist() == [0, 3, 7, 12, 16, 16, 16]
    assert padded_cu_seqlens(_cu(0, 5, 10, 15, 16), shape).tolist() == [0, 5, 10, 15, 16, 16, 16]   # full
    assert padded_cu_seqlens(_cu(0), shape).tolist() == [0, 5, 10, 15, 16, 16, 16]                   # empty
    assert padded_cu_seqlens(_cu(0, 3, 17), shape) == "tokens"
    assert padded_cu_seqlens(_cu(0, 6, 7), shape) == "max_seqlen"
    assert padded_cu_seqlens(_cu(0, 1, 2, 3, 4, 5, 6), shape) == "segments"   # 6 real + 2 padding
    assert padding_positions(7, shape).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot hold"):
        StaticShape(tokens=16, segments=3, max_seqlen=5)


def _batch():
    g = torch.Generator().manual_seed(5)

    def sample(frames, answer):
        return make_sample([("text", [5, 6]), ("speech", torch.randn(frames, 80, generator=g)),
                            ("answer", list(range(7, 7 + answer)))])

    ss = [sample(60, 3), sample(90, 5), sample(44, 2)]
    return packed_batch(ss, sum(len(s.ids) for s in ss) + 3)


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(batch)
    out["loss_sum"].backward()
    return float(out["loss_sum"].detach()), {n: p.grad.clone() for n, p in model.named_parameters()
                                             if p.grad is not None}


def _model(seed=0):
    cfg = tiny_config()
    cfg.freeze_llm = True
    torch.manual_seed(seed)
    return SpeechLLM(cfg).train().double()


def test_padded_rows_give_the_loss_and_gradients_of_the_unpadded_row():
    batch = _batch()
    batch = batch.__class__(**{k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                               for k, v in vars(batch).items() if k != "host"})
    width, longest = batch.input_ids.shape[1], batch.max_seqlen
    want_loss, want = _step(_model(), batch)
    model = _model()
    # padding longer than max_seqlen (three padding segments) and empty slots after them
    static = model.use_static_decoder(StaticShape(tokens=width + 2 * longest + 7, segments=12, max_seqlen=longest))
    loss, got = _step(model, batch)
    assert static.counts == {"static": 1}
    assert abs(loss - want_loss) <= 1e-12 * abs(want_loss)
    assert got.keys() == want.keys() and got
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12, msg=name)
    assert "1 LLM rows padded (eager) at" in static.summary() and "0 unpadded" in static.summary()


@pytest.mark.parametrize("reason", ["tokens", "max_seqlen", "segments"])
def test_rows_that_do_not_fit_run_unpadded_and_are_counted(reason):
    batch = _batch()
    width, longest = batch.input_ids.shape[1], batch.max_seqlen
    shape = {"tokens": StaticShape(width - 1, 64, longest),
             "max_seqlen": StaticShape(4 * width, 64, longest - 1),
             "segments": StaticShape(width, 3, longest)}[reason]
    want_loss, want = _step(_model().float(), batch)
    model = _model().float()
    static = model.use_static_decoder(shape)
    loss, got = _step(model, batch)
    assert static.counts == {f"eager: {reason}": 1}
    assert loss == want_loss and all(torch.equal(got[n], g) for n, g in want.items())   # the same eager path
    assert f"0 LLM rows padded (eager) at {shape.tokens} tokens, 1 unpadded ({reason} 1)" == static.summary()


def test_evaluation_and_no_grad_run_unpadded():
    model = _model().float()
    static = model.use_static_decoder(StaticShape(4096, 64, 512))
    batch = _batch()
    with torch.no_grad():
        model(batch)
    model.eval()
    model(batch)
    assert not static.counts


def test_a_trainable_llm_is_refused():
    cfg = tiny_config()   # freeze_llm false
    with pytest.raises(ValueError, match="frozen LLM"):
        SpeechLLM(cfg).use_static_decoder(StaticShape(64, 8, 16))


def test_config_rules(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from west.config import load_config
    from west.schema import ConfigError

    Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    base = [("model.llm.path", str(tmp_path)), ("train.cuda_graphs", "true"), ("data.batch_type", "pack"),
            ("model.freeze_llm", "true")]
    cfg = load_config(None, base)
    assert cfg.train.cuda_graphs and cfg.train.graph_segments == 256 and cfg.train.graph_max_seqlen == 512
    for extra, match in [([("data.batch_type", "static")], "train.cuda_graphs.*data.batch_type pack"),
                         ([("model.freeze_llm", "false")], "train.cuda_graphs.*frozen LLM"),
                         ([("model.lora.target_modules", "[q_proj]")], "train.cuda_graphs.*frozen LLM"),
                         ([("train.fsdp", "true")], "train.cuda_graphs.*fsdp"),
                         ([("model.llm.gradient_checkpointing", "true")], "train.cuda_graphs.*checkpoint_scope mlp"),
                         ([("data.pack_tokens", "8192"), ("train.graph_max_seqlen", "256"),
                           ("train.graph_segments", "31")], "train.graph_segments.*>= 32")]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, base + extra)
    ok = load_config(None, base + [("model.llm.gradient_checkpointing", "true"), ("model.llm.checkpoint_scope", "mlp")])
    assert ok.model.llm.recomputes_mlps()


def test_capture_records_the_padded_decoder_and_replays_it(monkeypatch):
    """west.train.cuda_graphs.capture with a stand-in for torch.cuda.make_graphed_callables (CUDA
    only) that records its arguments and returns the callable: the capture sees a row of padding
    at the static shape, tensors only (no host copy), and steps then go through the replay with the
    padded row's loss and gradients."""
    from west.train import cuda_graphs

    recorded = {}

    def fake_make_graphed_callables(fn, sample, num_warmup_iters):
        recorded.update(sample=sample, warmup=num_warmup_iters)
        fn(*sample).sum().backward()    # what the warm-up iterations do
        return fn

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_make_graphed_callables)
    batch = _batch()
    shape = StaticShape(tokens=batch.input_ids.shape[1] + 40, segments=16, max_seqlen=batch.max_seqlen)
    eager_static = _model().float()
    eager_static.use_static_decoder(shape)
    want_loss, want = _step(eager_static, batch)
    model = _model().float()
    static = model.use_static_decoder(shape)
    cuda_graphs.capture(static, model.llm.get_input_embeddings().weight, "fp32", warmup_iters=2)
    embeds, pos, cu = recorded["sample"]
    assert recorded["warmup"] == 2 and embeds.shape == (1, shape.tokens, embeds.shape[2]) and embeds.requires_grad
    assert pos.shape == (1, shape.tokens) and cu.shape == (shape.segments + 1,) and int(cu[-1]) == shape.tokens
    loss, got = _step(model, batch)
    assert static.counts == {"static": 1} and "1 LLM rows replayed at" in static.summary()
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_a_failed_capture_names_the_option(monkeypatch):
    from west.train import cuda_graphs

    def broken(fn, sample, num_warmup_iters):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", broken)
    model = _model().float()
    static = model.use_static_decoder(StaticShape(64, 8, 16))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with pytest.raises(RuntimeError, match="train.cuda_graphs: capturing the LLM decoder.*train.cuda_graphs false\\)$"):
        cuda_graphs.capture(static, model.llm.get_input_embeddings().weight, "fp32")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")   # what west-train sets on CUDA
    with pytest.raises(RuntimeError, match="or with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"):
        cuda_graphs.capture(static, model.llm.get_input_embeddings().weight, "fp32")
