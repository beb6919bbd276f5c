"""flash-attn's CPU stand-in (west.models.flash_reference) is one custom operator forward and one
backward, as the CUDA kernels dispatch, with an analytic backward equal to autograd through a
plain per-segment softmax attention: GQA, causal (bottom-right), query and key segments of
different lengths, empty segments, a value head size of its own."""
import pytest
import torch

from west.bench.op_counter import OpCounter
from west.models.flash_reference import flash_attn_varlen_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _plain(q, k, v, lq, lk, scale, causal):
    """Autograd's view: each segment on its own, k/v heads repeated, softmax over its keys."""
    rep, outs, a, b = q.shape[1] // k.shape[1], [], 0, 0
    for nq, nk in zip(lq, lk):
        qs, ks, vs = q[a:a + nq], k[b:b + nk].repeat_interleave(rep, 1), v[b:b + nk].repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            keep = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
            s = s.masked_fill(~keep, float("-inf"))
        p = s.softmax(-1).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
        a, b = a + nq, b + nk
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [([7, 0, 30, 1, 12], [7, 0, 30, 1, 12]),    # self-attention, an empty segment
                                   ([3, 9, 20], [8, 9, 11])])                  # queries and keys apart
def test_forward_and_analytic_backward_equal_autograd(lq, lk, causal):
    g = torch.Generator().manual_seed(len(lq) + causal)
    hq, hkv, d, dv = 6, 2, 8, 5
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), hkv, dv, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(sum(lq), hq, dv, generator=g, dtype=torch.float64)
    out = flash_attn_varlen_reference(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), softmax_scale=0.4, causal=causal)
    want = _plain(q, k, v, lq, lk, 0.4, causal)
    assert out.shape == want.shape and (out - want).abs().max() < 1e-12
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, ref):
        assert (a - b).abs().max() < 1e-12, name


def test_one_operator_each_way_and_traced_whole():
    q, k, v = (torch.randn(20, 2, 4, requires_grad=True) for _ in range(3))
    cu = _cu([12, 8])
    with OpCounter() as c:
        flash_attn_varlen_reference(q, k, v, cu, cu, 12, 12, causal=True).sum().backward()
    assert c.counts["other"]["west.varlen_reference"] == 1
    assert c.counts["backward"]["west.varlen_reference_backward"] == 1
    assert not any("mm" in op or "softmax" in op for phase in c.counts.values() for op in phase)

    def f(q, k, v, cu):
        return flash_attn_varlen_reference(q, k, v, cu, cu, 12, 12) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, cu), f(q, k, v, cu))
