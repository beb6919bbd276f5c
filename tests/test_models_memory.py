"""What trades compute for memory must not change the step: activation checkpointing of the
encoder blocks and the LLM layers gives the same loss and gradients as keeping activations."""
import pytest
import torch

from west.models.speech_llm import SpeechLLM

from helpers.speech import packed_batch, padded_batch, samples, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _grads(model: SpeechLLM, batch):
    model.zero_grad(set_to_none=True)
    out = model(batch)
    out["loss_sum"].backward()
    return float(out["loss_sum"].detach()), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}


@pytest.mark.parametrize("layout,layers", [("pack", None), ("padded", None), ("pack", 1)])
def test_activation_checkpointing_same_loss_and_gradients(layout, layers):
    """``layers``: model.llm.checkpoint_layers (None: every decoder layer is replayed)."""
    ss = samples()
    batch = packed_batch(ss, sum(len(s.ids) for s in ss) + 4) if layout == "pack" else padded_batch(ss)
    torch.manual_seed(0)
    plain = SpeechLLM(tiny_config()).train()      # dropout is 0 in tiny_config: train mode is deterministic
    cfg = tiny_config()
    cfg.encoder.gradient_checkpointing = True
    cfg.llm.gradient_checkpointing = True
    cfg.llm.checkpoint_layers = layers
    torch.manual_seed(0)
    ckpt = SpeechLLM(cfg).train()
    assert ckpt.encoder.gradient_checkpointing and ckpt.llm.model.gradient_checkpointing
    decoder_layers = ckpt.llm.model.layers
    assert len(decoder_layers) >= 2
    expect = len(decoder_layers) if layers is None else layers
    assert [m.gradient_checkpointing for m in decoder_layers] == [i < expect for i in range(len(decoder_layers))]
    calls = []
    for i, m in enumerate(decoder_layers):   # a checkpointed layer's forward runs again in the backward
        m.mlp.register_forward_pre_hook(lambda mod, args, i=i: calls.append(i))
    loss_a, grads_a = _grads(plain, batch)
    loss_b, grads_b = _grads(ckpt, batch)
    assert sorted(calls) == sorted(list(range(len(decoder_layers))) + list(range(expect)))
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == sum(1 for _ in plain.parameters())
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)


def test_checkpoint_layers_is_checked():
    from west.config import load_config
    from west.schema import ConfigError

    with pytest.raises(ConfigError, match="model.llm.checkpoint_layers.*gradient_checkpointing true"):
        load_config(None, [("model.llm.checkpoint_layers", "2")])
    cfg = tiny_config()
    cfg.llm.gradient_checkpointing, cfg.llm.checkpoint_layers = True, 99
    with pytest.raises(ValueError, match="checkpoint_layers 99 > the LLM's 2 decoder layers"):
        SpeechLLM(cfg)


def test_chunked_loss_in_the_model_equals_the_plain_loss():
    """model.loss chunked (tiles of 3 rows here, so several per batch) against plain: the same loss,
    correct-token count and gradients, through the whole model."""
    ss = samples()
    batch = packed_batch(ss, sum(len(s.ids) for s in ss) + 4)
    results = {}
    for impl in ("plain", "chunked"):
        torch.manual_seed(0)
        model = SpeechLLM(tiny_config(loss=impl, loss_chunk_rows=3)).eval()
        model.zero_grad(set_to_none=True)
        out = model(batch)
        out["loss_sum"].backward()
        results[impl] = (float(out["loss_sum"].detach()), int(out["n_correct"]),
                         {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (la, ca, ga), (lb, cb, gb) = results["plain"], results["chunked"]
    assert la == pytest.approx(lb, rel=1e-6) and ca == cb and ga.keys() == gb.keys()
    scale = max(float(g.abs().max()) for g in ga.values())
    for name in ga:   # relative to the largest gradient: some (k biases) are zero up to rounding
        err = float((gb[name] - ga[name]).abs().max())
        assert err <= 1e-5 * scale, (name, err, scale)
