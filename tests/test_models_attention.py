"""Packed attention backends vs a dense float64 block-diagonal reference."""
import inspect
import warnings

import pytest
import torch

from west.models.attention import (
    SegmentPlan,
    bucket_length,
    flash_attn_varlen_reference,
    flash_varlen,
    flex_document_attention,
    reference_attention,
    segment_sdpa,
    varlen_attention,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENS = [5, 17, 3, 17, 40, 1, 33, 18]


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _qkv(total, hq=4, hkv=2, d=8, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, h, d, generator=g) for h in (hq, hkv, hkv))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def test_reference_matches_naive_per_segment_loop():
    q, k, v = _qkv(sum(LENS))
    cu = _cu(LENS)
    ref = reference_attention(q, k, v, cu, causal=True)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = q[a:b].double(), k[a:b].double().repeat_interleave(2, 1), v[a:b].double().repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) / 8 ** 0.5
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(ref[a:b], torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))


def test_bucket_length_bounds():
    for n in range(1, 3000):
        b = bucket_length(n, 8)
        assert n <= b < n * (1 + 1 / 8) + 1
        assert bucket_length(n, None) == n


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bpo", [None, 2, 8])
def test_segment_sdpa_matches_reference_fwd_and_grad(causal, bpo):
    q, k, v = _qkv(sum(LENS), grad=True)
    cu = _cu(LENS)
    plan = SegmentPlan.from_cu_seqlens(cu, buckets_per_octave=bpo)
    out = segment_sdpa(q, k, v, plan, causal=causal)
    ref = reference_attention(q, k, v, cu, causal=causal)
    assert (out.double() - ref).abs().max() < 1e-5
    w = torch.randn_like(ref)
    g = torch.autograd.grad((out.double() * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        assert (a.double() - b).abs().max() < 1e-5


def test_segment_sdpa_with_bias_matches_reference():
    q, k, v = _qkv(sum(LENS), hq=2, hkv=2)
    cu = _cu(LENS)
    total = q.shape[0]
    dense_bias = torch.randn(2, total, total)
    plan = SegmentPlan.from_cu_seqlens(cu, buckets_per_octave=2)  # padded groups exercise key masking

    def bias_fn(qg, group):
        index = group.index
        assert qg.shape[0] == index.shape[0] and qg.shape[2] == group.length   # (G, H, n, D)
        return dense_bias[:, index[:, :, None], index[:, None, :]].permute(1, 0, 2, 3)

    out = segment_sdpa(q, k, v, plan, bias_fn=bias_fn)
    ref = reference_attention(q, k, v, cu, bias=dense_bias)
    assert (out.double() - ref).abs().max() < 1e-5


def test_padded_plan_keeps_all_rows():
    lens, t = [3, 7, 5], 7
    q, k, v = _qkv(len(lens) * t, hq=2, hkv=2)
    out = segment_sdpa(q, k, v, SegmentPlan.padded(lens, t))
    for i, n in enumerate(lens):
        rows = slice(i * t, i * t + n)
        ref = reference_attention(q[rows], k[rows], v[rows], _cu([n]))
        assert (out[rows].double() - ref).abs().max() < 1e-5


def test_flash_reference_has_the_exact_flash_signature():
    names = list(inspect.signature(flash_attn_varlen_reference).parameters)
    assert names[:10] == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                          "dropout_p", "softmax_scale", "causal"]
    assert list(inspect.signature(flash_varlen).parameters) == names


@pytest.mark.parametrize("causal", [False, True])
def test_flash_path_on_cpu_matches_reference(causal):
    q, k, v = _qkv(sum(LENS))
    cu = _cu(LENS)
    out = flash_varlen(q, k, v, cu, cu, max(LENS), max(LENS), softmax_scale=0.3, causal=causal)
    ref = reference_attention(q, k, v, cu, causal=causal, scale=0.3)
    assert (out.double() - ref).abs().max() < 1e-5
    out2 = varlen_attention(q, k, v, cu, max(LENS), causal=causal, scale=0.3, backend="flash")
    assert torch.equal(out, out2)


def test_flash_reference_rejects_bad_cu_seqlens():
    q, k, v = _qkv(10)
    with pytest.raises(TypeError):
        flash_attn_varlen_reference(q, k, v, torch.tensor([0, 10]), torch.tensor([0, 10]), 10, 10)
    bad = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError):
        flash_attn_varlen_reference(q, k, v, bad, bad, 10, 10)


def test_auto_backend_on_cpu_is_segment_sdpa():
    q, k, v = _qkv(sum(LENS))
    cu = _cu(LENS)
    a = varlen_attention(q, k, v, cu, max(LENS), causal=True)
    b = segment_sdpa(q, k, v, SegmentPlan.from_cu_seqlens(cu, buckets_per_octave=8), causal=True)
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        varlen_attention(q, k, v, cu, max(LENS), causal=True, backend="nope")


@pytest.mark.parametrize("causal", [False, True])
def test_flex_forward_on_cpu_matches_reference(causal):
    """FlexAttention runs forward-only on CPU (unfused); the GPU path compiles it."""
    q, k, v = _qkv(sum(LENS))
    cu = _cu(LENS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            out = flex_document_attention(q, k, v, cu, causal=causal)
    ref = reference_attention(q, k, v, cu, causal=causal)
    assert (out.double() - ref).abs().max() < 1e-5
    with pytest.raises(NotImplementedError):
        flex_document_attention(q.requires_grad_(), k, v, cu, causal=causal)


def test_empty_segments_are_skipped():
    lens = [4, 0, 6]
    q, k, v = _qkv(10)
    out = segment_sdpa(q, k, v, SegmentPlan.from_lengths(lens), causal=True)
    ref = reference_attention(q, k, v, _cu(lens), causal=True)
    assert (out.double() - ref).abs().max() < 1e-5
