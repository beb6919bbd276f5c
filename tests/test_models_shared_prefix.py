"""Attention over pack rows whose samples share one prompt prefix (west.models.shared_prefix).

A row [prefix | sample 1 | sample 2 | tail] with key rows gathered per segment must give each
sample what the plain layout [prefix + sample 1 | prefix + sample 2 | tail] gives it. Every path
(segment SDPA on the CPU, flash-attn's signature through its reference, torch's varlen kernel
through stand-ins with its keyword sets) against flash-attn's reference on the gathered keys, and
against the plain layout itself, values and gradients."""
import pytest
import torch

from west.models import varlen_kernels as K
from west.models.attention import LazySegmentPlan, varlen_attention
from west.models.flash_reference import flash_attn_varlen_reference
from west.models.shared_prefix import KeyRows, keyed_plan

P, OWN = 4, [6, 1, 11, 3]          # the prefix, then each sample's own tokens
TAIL = 5                           # a non-full row's dummy segment


def _int32(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def shared_row():
    """(query boundaries, key rows) of [prefix | samples | tail]: the prefix and the tail see themselves."""
    lens = [P, *OWN, TAIL]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    rows = [list(range(0, P))]
    rows += [list(range(P)) + list(range(cu[i + 1], cu[i + 2])) for i in range(len(OWN))]
    rows.append(list(range(cu[-2], cu[-1])))
    key_cu = [0]
    for r in rows:
        key_cu.append(key_cu[-1] + len(r))
    index = torch.tensor([i for r in rows for i in r])
    keys = KeyRows(index, _int32(key_cu), max(len(r) for r in rows), index, _int32(key_cu))
    return _int32(cu), keys


def plain_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """The same tokens laid out whole: each sample with the prefix in front; (rows, boundaries,
    where each shared row's tokens went)."""
    cu = shared_row()[0].tolist()
    parts, place, at = [], [], 0
    for i in range(len(OWN)):
        own = list(range(cu[i + 1], cu[i + 2]))
        parts.append(x[list(range(P)) + own])
        place.append(list(range(at, at + P + len(own))))
        at += P + len(own)
    parts.append(x[cu[-2]:cu[-1]])
    lens = [len(p) for p in parts]
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    return torch.cat(parts), _int32(bounds), place


def _qkv(hq=4, hkv=2, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    rows = P + sum(OWN) + TAIL
    return [torch.randn(rows, h, d, generator=g, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [2, 4])
def test_segment_sdpa_with_key_rows_equals_flash_semantics(causal, hkv):
    """The CPU path (segments batched by length, a bottom-right mask) against flash-attn's reference
    on the gathered keys: values and the gradients reaching q, k and v through the gather."""
    q, k, v = _qkv(hkv=hkv)
    cu, keys = shared_row()
    plan = LazySegmentPlan(cu, buckets_per_octave=2)
    got = varlen_attention(q, k, v, cu, 11, causal=causal, scale=0.3, backend="sdpa_segments", plan=plan, keys=keys)
    want = flash_attn_varlen_reference(q, k[keys.index], v[keys.index], cu, keys.cu_seqlens, 11, keys.max_seqlen,
                                       softmax_scale=0.3, causal=causal)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, (q, k, v), grad),
                               torch.autograd.grad(want, (q, k, v), grad))


def test_a_sample_sees_with_the_shared_prefix_what_it_sees_with_its_own():
    """The property data.shared_prefix rests on, on every output row of the shared layout, and for the
    gradients of the prefix's rows (summed over the samples that read them)."""
    q, k, v = _qkv()
    cu, keys = shared_row()
    shared = varlen_attention(q, k, v, cu, 11, causal=True, backend="sdpa_segments", keys=keys)
    (pq, plain_cu, place), (pk, _, _), (pv, _, _) = (plain_rows(t) for t in (q, k, v))
    plain = varlen_attention(pq, pk, pv, plain_cu, P + 11, causal=True, backend="sdpa_segments")
    for i, rows in enumerate(place):
        own = list(range(int(cu[i + 1]), int(cu[i + 2])))
        torch.testing.assert_close(shared[own], plain[rows[P:]])
        torch.testing.assert_close(shared[:P], plain[rows[:P]])   # the prefix: the same in every sample
    torch.testing.assert_close(shared[int(cu[-2]):], plain[-TAIL:])
    # a loss on the samples' rows only: the prefix's k/v gradients are what all the samples pass back
    own_rows = list(range(P, int(cu[-2])))
    plain_own = [r for rows in place for r in rows[P:]]
    g_shared = torch.autograd.grad(shared[own_rows].square().sum(), (k, v))
    g_plain = torch.autograd.grad(plain[plain_own].square().sum(), (k, v))
    torch.testing.assert_close(g_shared, g_plain)


def _window_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):
    """torch 2.10-2.11's keywords; window (-1, 0) is flash's causal window, aligned bottom-right."""
    _window_kernel.calls.append((cu_seq_q, cu_seq_k, max_q, max_k))
    return flash_attn_varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                       softmax_scale=scale, causal=window_size == (-1, 0))


def _causal_flag_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9's keywords: a causal flag whose alignment for more keys than queries is not stated."""
    raise AssertionError("must not be called with key rows")


def test_torch_varlen_takes_the_key_boundaries_and_the_causal_window(monkeypatch):
    monkeypatch.setattr(K, "_GQA_NATIVE", {})
    _window_kernel.calls = []
    q, k, v = (t.detach().float() for t in _qkv(hkv=4))
    cu, keys = shared_row()
    monkeypatch.setattr(K, "_torch_varlen_kernel", lambda: _window_kernel)
    got = varlen_attention(q, k, v, cu, 11, causal=True, backend="torch_varlen", keys=keys)
    want = varlen_attention(q, k, v, cu, 11, causal=True, backend="sdpa_segments", keys=keys)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    cu_q, cu_k, max_q, max_k = _window_kernel.calls[-1]
    assert cu_q is cu and cu_k is keys.cu_seqlens and (max_q, max_k) == (11, keys.max_seqlen)
    monkeypatch.setattr(K, "_torch_varlen_kernel", lambda: _causal_flag_kernel)
    with pytest.raises(RuntimeError, match="window_size"):
        varlen_attention(q, k, v, cu, 11, causal=True, backend="torch_varlen", keys=keys)


def test_key_rows_are_refused_where_they_cannot_be_honoured():
    q, k, v = (t.detach() for t in _qkv())
    cu, keys = shared_row()
    with pytest.raises(NotImplementedError, match="shared prefix"):
        varlen_attention(q, k, v, cu, 11, causal=True, backend="flex", keys=keys)
    with pytest.raises(ValueError, match="fewer keys than queries"):
        keyed_plan(cu, _int32([0, 1, 2, 3, 3, 3, 3]), keys.index[:3], torch.device("cpu"), causal=True)


@pytest.mark.parametrize("backend", ["sdpa_segments", "flash"])
def test_prefix_rows_gradients_in_bf16_are_as_close_as_the_other_rows(backend):
    """A row's prefix keys and values gather their gradients from every sample (one bf16 rounding
    per sample, in the gathers' backward), where the plain layout gives each copy its own: against
    float64, that must cost them no more than the other rows' error (docs/benchmarks.md gives the
    figures at 84 samples)."""
    from west.models.shared_prefix import prefix_row

    gen = torch.Generator().manual_seed(0)
    prefix, lens = 14, [60 + (i * 7) % 30 for i in range(40)]
    cu, keys = prefix_row(prefix, lens)
    rows = prefix + sum(lens)
    q, g = (torch.randn(rows, 4, 32, generator=gen) for _ in range(2))
    k, v = (torch.randn(rows, 2, 32, generator=gen) for _ in range(2))

    def grads(dtype: torch.dtype, how: str):
        qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
        out = varlen_attention(qq, kk, vv, cu, max(lens), causal=True, backend=how, keys=keys)
        (out.double() * g).sum().backward()
        return kk.grad.double(), vv.grad.double()

    def err(x, ref):
        return float((x - ref).norm() / ref.norm())

    for got, ref in zip(grads(torch.bfloat16, backend), grads(torch.float64, "sdpa_segments")):
        shared, own = err(got[:prefix], ref[:prefix]), err(got[prefix:], ref[prefix:])
        assert shared < 1e-2 and own < 1e-2
        assert shared < 1.5 * own, (shared, own)
