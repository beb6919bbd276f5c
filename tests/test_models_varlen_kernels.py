"""Which packed-attention kernel runs where, and torch's varlen kernel driven exactly.

No GPU here: the choice is tested with the detection overridden, and ``torch_varlen`` with
stand-in kernels that have the two keyword sets torch releases gave ``varlen_attn``."""
import logging

import pytest
import torch

from west.models import varlen_kernels as K
from west.models.attention import LazySegmentPlan, SegmentPlan, reference_attention, varlen_attention
from west.models.hf_attention import packed_kwargs

LENS = [5, 17, 3, 1, 12]
CUDA = torch.device("cuda")


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _qkv(hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENS)
    return [torch.randn(total, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("device,dtype,flash,tv,dropout,want", [
    ("cpu", torch.float32, False, False, False, "sdpa_segments"),
    ("cpu", torch.bfloat16, True, True, False, "sdpa_segments"),     # flash-attn is CUDA-only
    (CUDA, torch.bfloat16, True, True, False, "flash"),              # installed flash-attn wins
    (CUDA, torch.float16, False, True, False, "torch_varlen"),       # no flash-attn: torch's kernel
    (CUDA, torch.bfloat16, False, True, True, "sdpa_segments"),      # torch's kernel has no dropout
    (CUDA, torch.bfloat16, True, True, True, "flash"),               # flash-attn has
    (CUDA, torch.float32, True, True, False, "sdpa_segments"),       # varlen kernels are half only
    (CUDA, torch.bfloat16, False, False, False, "sdpa_segments"),    # old torch / pre-Ampere
])
def test_choice_by_device_dtype_and_packages(device, dtype, flash, tv, dropout, want):
    assert K.choose_backend(device, dtype, dropout=dropout, flash=flash, torch_varlen_ok=tv) == want


def test_choice_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(K, "_logged", set())
    with caplog.at_level(logging.INFO, logger=K.__name__):
        for _ in range(3):
            K.choose_backend(CUDA, torch.bfloat16, flash=False, torch_varlen_ok=True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["packed attention on cuda/bfloat16: torch_varlen "
                     "(flash-attn is not installed; torch.nn.attention.varlen)"]


def test_cuda_without_a_gpu_never_picks_torch_varlen():
    """Detection itself (no override): without a device to ask, the kernel is not assumed."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert K.choose_backend(CUDA, torch.bfloat16, flash=False) == "sdpa_segments"


def _new_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False):
    """torch >= 2.10's keyword set, with flash-attn's semantics."""
    assert window_size in ((-1, -1), (-1, 0)) and return_aux is None
    assert enable_gqa or query.shape[1] == key.shape[1]
    return K.flash_attn_varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                         softmax_scale=scale, causal=window_size == (-1, 0))


def _old_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9's keyword set: no scale, no GQA."""
    assert query.shape[1] == key.shape[1], "GQA must be expanded for this kernel"
    return K.flash_attn_varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal)


@pytest.mark.parametrize("kernel", [_new_kernel, _old_kernel], ids=["window_size", "is_causal"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.2])
def test_torch_varlen_equals_the_reference(kernel, causal, scale):
    q, k, v = _qkv()
    cu = _cu(LENS)
    out = K.torch_varlen(q, k, v, cu, max(LENS), causal=causal, scale=scale, kernel=kernel)
    ref = reference_attention(q, k, v, cu, causal=causal, scale=scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)  # the stand-ins compute in float32


def test_torch_varlen_reads_a_kernels_signature_once(monkeypatch):
    """inspect.signature costs the host about 15 us, and the call runs once per layer and step."""
    reads = []
    real = K.inspect.signature
    monkeypatch.setattr(K, "_PARAMETERS", {})
    monkeypatch.setattr(K.inspect, "signature", lambda fn: reads.append(fn) or real(fn))
    q, k, v = _qkv()
    cu = _cu(LENS)
    for kernel in (_new_kernel, _old_kernel, _new_kernel, _old_kernel):
        out = K.torch_varlen(q, k, v, cu, max(LENS), causal=True, scale=0.2, kernel=kernel)
        torch.testing.assert_close(out, reference_attention(q, k, v, cu, causal=True, scale=0.2),
                                   atol=1e-5, rtol=1e-4)
    assert reads == [_new_kernel, _old_kernel]


def _mid_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    """torch 2.10-2.11's keyword set: no enable_gqa; fewer key/value heads go to flash attention,
    which groups the query heads itself."""
    _mid_kernel.heads.append(key.shape[1])
    return K.flash_attn_varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                         softmax_scale=scale, causal=window_size == (-1, 0))


def _mid_kernel_misgrouped(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                           window_size=(-1, -1)):
    """The same keywords, but it pairs query head h with key/value head h % Hkv (not h // group) without a word."""
    _mid_kernel_misgrouped.heads.append(key.shape[1])
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat(1, rep, 1), value.repeat(1, rep, 1)
    return K.flash_attn_varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                         softmax_scale=scale, causal=window_size == (-1, 0))


def _mid_kernel_strict(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1)):
    """The same keywords, and it refuses fewer key/value heads."""
    if query.shape[1] != key.shape[1]:
        raise RuntimeError("number of heads in key/value must equal the query's")
    _mid_kernel_strict.heads.append(key.shape[1])
    return K.flash_attn_varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                         softmax_scale=scale, causal=window_size == (-1, 0))


@pytest.mark.parametrize("kernel,grouped", [(_mid_kernel, True), (_mid_kernel_misgrouped, False),
                                            (_mid_kernel_strict, False)], ids=["groups", "misgroups", "refuses"])
def test_a_kernel_without_enable_gqa_gets_the_heads_as_they_are_only_where_a_probe_shows_it_groups_them(
        kernel, grouped, monkeypatch, caplog):
    monkeypatch.setattr(K, "_GQA_NATIVE", {})
    kernel.heads = []
    q, k, v = (t.float() for t in _qkv(hq=4, hkv=2, d=8))
    cu = _cu(LENS)
    before = torch.random.get_rng_state()
    with caplog.at_level(logging.INFO, logger=K.__name__):
        for _ in range(2):
            out = K.torch_varlen(q, k, v, cu, max(LENS), causal=True, scale=0.3, kernel=kernel)
            torch.testing.assert_close(out, reference_attention(q, k, v, cu, causal=True, scale=0.3).float(),
                                       atol=1e-5, rtol=1e-4)
    assert torch.equal(torch.random.get_rng_state(), before)   # the probe draws from a generator of its own
    assert K._GQA_NATIVE == {(kernel, "cpu", None, torch.float32): grouped}   # probed once
    assert kernel.heads[-2:] == [2 if grouped else 4] * 2     # the real calls: as they are, or repeated
    assert sum("grouped key/value heads" in r.getMessage() for r in caplog.records) == 1
    # inside a trace the probe is not run, nor cached: the heads are repeated, which is exact anyway
    monkeypatch.setattr(K, "_GQA_NATIVE", {})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    kernel.heads = []
    K.torch_varlen(q, k, v, cu, max(LENS), causal=True, kernel=kernel)
    assert kernel.heads == [4] and K._GQA_NATIVE == {}


def test_torch_varlen_refuses_a_kernel_without_causality():
    def no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        return query

    q, k, v = _qkv(hq=2)
    with pytest.raises(RuntimeError, match="no causal option"):
        K.torch_varlen(q, k, v, _cu(LENS), max(LENS), causal=True, kernel=no_causal)


def test_kernels_without_dropout_refuse_it_by_name():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="torch_varlen backend: attention dropout"):
        varlen_attention(q, k, v, _cu(LENS), max(LENS), causal=True, dropout_p=0.1, backend="torch_varlen")


def test_lazy_plan_is_built_once_and_only_when_needed():
    q, k, v = (t.float() for t in _qkv())
    cu = _cu(LENS)
    kw = packed_kwargs(cu, max(LENS), backend="auto")
    lazy = kw["west_segment_plan"]
    assert isinstance(lazy, LazySegmentPlan) and lazy._plan is None   # nothing built yet
    outs = [varlen_attention(q, k, v, cu, max(LENS), causal=True, plan=lazy) for _ in range(2)]
    assert isinstance(lazy._plan, SegmentPlan)
    first = lazy._plan
    varlen_attention(q, k, v, cu, max(LENS), causal=True, plan=lazy)
    assert lazy._plan is first                                        # shared by every layer
    torch.testing.assert_close(outs[0].double(), reference_attention(q, k, v, cu, causal=True),
                               atol=1e-5, rtol=1e-5)


def test_the_gqa_probe_inside_an_activation_checkpoint_leaves_the_replay_equal_to_the_forward(monkeypatch):
    """The first grouped call of a kernel without enable_gqa probes it; inside a non-reentrant
    checkpoint (a checkpointed decoder layer's first step) the probe's own tensors must not be
    counted among the layer's saved ones, or the backward's replay sees fewer (CheckpointError)."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(K, "_GQA_NATIVE", {})
    _mid_kernel.heads = []
    q, k, v = (t.float().requires_grad_() for t in _qkv(hq=4, hkv=2, d=8))
    cu = _cu(LENS)

    def layer(q, k, v):
        return K.torch_varlen(q, k, v, cu, max(LENS), causal=True, kernel=_mid_kernel) * 2.0

    grad_out = torch.randn(q.shape)
    got = torch.autograd.grad(checkpoint(layer, q, k, v, use_reentrant=False), (q, k, v), grad_out)
    want = torch.autograd.grad(reference_attention(q, k, v, cu, causal=True).float() * 2.0, (q, k, v), grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert K._GQA_NATIVE == {(_mid_kernel, "cpu", None, torch.float32): True}
