"""model.llm.fused_swiglu: a frozen SwiGLU MLP's elementwise work as one compiled kernel each way
(inductor's C++ here, Triton on CUDA). The stock operators' values up to rounding, and no further
from exact than they are in bf16; gate and up kept (not silu(gate) too), or only the input with
checkpoint_scope mlp; one compilation for every batch size; refused where the MLP trains."""
import pytest
import torch
import torch.nn.functional as F

from west.models.fused_swiglu import fused, silu_mul, swiglu_grads
from west.models.llm import decoder_layers
from west.models.mlp_checkpoint import FrozenSwiGLU, checkpoint_mlps, fuse_swiglus, fuses, recomputes

from test_models_mlp_checkpoint import _llm, _run, _scoped

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _stock_grads(dh, g, u):
    g, u = g.detach().requires_grad_(True), u.detach().requires_grad_(True)
    (F.silu(g) * u).backward(dh)
    return g.grad, u.grad


def test_the_formulas_are_silu_mul_and_its_gradients():
    gen = torch.Generator().manual_seed(0)
    g, u, dh = (torch.randn(5, 40, dtype=torch.float64, generator=gen) * 3 for _ in range(3))
    torch.testing.assert_close(silu_mul(g, u), F.silu(g) * u, rtol=1e-14, atol=1e-14)
    for got, want in zip(swiglu_grads(dh, g, u), _stock_grads(dh, g, u)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_compiled_in_bf16_no_further_from_exact_than_the_stock_operators():
    gen = torch.Generator().manual_seed(1)
    g64, u64, dh64 = (torch.randn(7, 96, dtype=torch.float64, generator=gen) * 2 for _ in range(3))
    g, u, dh = (t.bfloat16() for t in (g64, u64, dh64))
    exact = [F.silu(g.double()) * u.double(), *_stock_grads(dh.double(), g.double(), u.double())]
    stock = [F.silu(g) * u, *_stock_grads(dh, g, u)]
    compiled = [fused("silu_mul")(g, u), *fused("swiglu_grads")(dh, g, u)]
    for c, s, e in zip(compiled, stock, exact):
        assert c.dtype == torch.bfloat16
        assert (c.double() - e).norm() <= (s.double() - e).norm() * 1.05
        torch.testing.assert_close(c.float(), s.float(), rtol=2e-2, atol=2e-2)   # a bf16 rounding or two


@pytest.mark.parametrize("recompute", [False, True])
def test_frozen_mlp_fused_gives_the_stock_values(recompute):
    """float64 (near exact) and bf16 (within rounding), output and input gradient, kept or recomputed."""
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 3e-2)):
        x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
        h0, g0 = _run(_llm(dtype), x)
        model = _scoped(_llm(dtype), "mlp") if recompute else _llm(dtype)
        assert fuse_swiglus(decoder_layers(model)) == 2
        assert all(fuses(b.mlp) and recomputes(b.mlp) == recompute for b in decoder_layers(model))
        h1, g1 = _run(model, x)
        torch.testing.assert_close(h1, h0, rtol=tol, atol=tol)
        torch.testing.assert_close(g1, g0, rtol=tol, atol=tol)


def test_keeps_gate_and_up_not_silu_gate_too():
    x = torch.randn(3, 7, 32, requires_grad=True)

    def kept_elements(mlp):
        kept, weights = [], {w.data_ptr() for w in mlp.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            mlp(x * 1.0)
        return sum(t.numel() for t in kept if t.data_ptr() not in weights)

    stock = _llm(torch.float32).model.layers[0]
    fused_layer = _llm(torch.float32).model.layers[0]
    fuse_swiglus([fused_layer])
    assert kept_elements(stock.mlp) >= 3 * 3 * 7 * 80
    assert kept_elements(fused_layer.mlp) == 2 * 3 * 7 * 80          # gate and up at 80 wide
    both = _llm(torch.float32).model.layers[0]
    fuse_swiglus([both])
    checkpoint_mlps([both])                                          # the trainer's hook re-routes: stays fused
    assert fuses(both.mlp) and recomputes(both.mlp)
    assert kept_elements(both.mlp) == 3 * 7 * 32                     # the input alone


def test_one_compilation_for_every_batch_size():
    from west.train.compile import compilations

    model = _llm(torch.float32)
    fuse_swiglus(decoder_layers(model))
    _run(model, torch.randn(1, 5, 32))     # compiles what this process has not compiled yet
    before = compilations()
    for n in (3, 11, 17):
        _run(model, torch.randn(2, n, 32))
    assert compilations() == before


def test_under_a_counting_dispatch_mode_the_same_arithmetic_runs_eagerly():
    """The benchmark counts FLOPs and operators under dispatch modes, where dynamo compiles nothing."""
    from torch.utils.flop_counter import FlopCounterMode

    from west.bench.op_counter import OpCounter

    g, u, dh = (torch.randn(4, 9, 24) for _ in range(3))
    for mode in (FlopCounterMode(display=False), OpCounter()):
        with mode:
            out, grads = fused("silu_mul")(g, u), fused("swiglu_grads")(dh, g, u)
        assert torch.equal(out, silu_mul(g, u))
        assert all(torch.equal(a, b) for a, b in zip(grads, swiglu_grads(dh, g, u)))
    assert mode.totals()["total"] > 2   # counted as the eager operators they are there


@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_layers_take_the_stock_or_checkpointed_mlp_without_a_break(recompute):
    """Under train.compile the layer's compilation fuses the elementwise work itself: the routed MLP
    traces into the layer's graph (no break, no nested compiled call) and computes what eager does."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    eager = _run(_llm(torch.float32), x)
    model = _scoped(_llm(torch.float32), "mlp") if recompute else _llm(torch.float32)
    fuse_swiglus(decoder_layers(model))
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, backend="aot_eager")
    compiled = _run(model, x)
    assert sum(counters["graph_break"].values()) == 0
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_gradcheck():
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64),
          torch.randn(6, 5, dtype=torch.float64)]
    for recompute in (False, True):
        assert torch.autograd.gradcheck(lambda t: FrozenSwiGLU.apply(t, *ws, recompute, True), (x,))


def test_a_trainable_mlp_is_refused():
    layer = _llm(torch.float32).model.layers[0]
    layer.mlp.gate_proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="model.llm.fused_swiglu: decoder layer 0's MLP trains"):
        fuse_swiglus([layer])


def test_config_rules_and_the_speech_llm(tmp_path):
    from west.config import load_config
    from west.models.speech_llm import SpeechLLM
    from west.schema import ConfigError

    from helpers.speech import packed_batch, samples, tiny_config

    with pytest.raises(ConfigError, match="model.freeze_llm.*model.llm.fused_swiglu"):
        load_config(None, [("model.llm.fused_swiglu", "true"), ("model.freeze_llm", "false")])
    with pytest.raises(ConfigError, match="model.lora.*model.llm.fused_swiglu"):
        load_config(None, [("model.llm.fused_swiglu", "true"), ("model.lora.target_modules", "[q_proj, up_proj]")])
    ss = samples()
    batch = packed_batch(ss, sum(len(s.ids) for s in ss) + 4)
    out = {}
    for on in (False, True):
        cfg = tiny_config()
        cfg.freeze_llm, cfg.llm.fused_swiglu = True, on
        torch.manual_seed(0)
        model = SpeechLLM(cfg).train()
        assert all(fuses(b.mlp) == on for b in decoder_layers(model.llm))
        loss = model(batch)["loss_sum"]
        loss.backward()
        out[on] = (float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5)
    assert out[True][1].keys() == out[False][1].keys() and out[True][1]
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_the_benchmark_tool_times_every_variant_and_counts_what_each_keeps(tmp_path):
    import json

    from helpers.e2e import import_tool

    out = tmp_path / "swiglu.json"
    assert import_tool("bench_swiglu").main(["--device", "cpu", "--rows", "64", "--hidden", "16", "--intermediate",
                                             "48", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["elementwise_ms"]) == {"stock", "fused"} and all(v > 0 for v in res["elementwise_ms"].values())
    kept = {name: v["kept_mib"] for name, v in res["mlp"].items()}
    tensor = 64 * 48 * 2 / 2**20   # one bf16 tensor of rows x intermediate
    assert kept["stock"] == pytest.approx(3 * tensor) and kept["fused (gate and up kept)"] == pytest.approx(2 * tensor)
    assert kept["recomputed (checkpoint_scope mlp)"] == kept["recomputed and fused"] == 0   # the input alone
