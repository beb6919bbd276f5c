"""``pos_enc: wenet`` computes its positional term inside q and k, each head twice as wide
(RelPositionAttention._key_position_attention): on every route it meets the dense float64
reference of the bias form it replaces (west.models.flex.rel_pos_reference), values and gradients,
and ``auto`` hands packed rows to a cu_seqlens kernel where one runs."""
import pytest
import torch

import west.models.conformer as conformer
from west.models.attention import bucket_length
from west.models.conformer import RelPositionAttention, encoder_backend, relative_sinusoids
from west.models.flex import rel_pos_reference
from west.models.layout import FrameLayout
from west.schema import ConfigError

from helpers.e2e import tiny_encoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENS = [5, 40, 17, 1, 33]
D, H = 32, 4


@pytest.mark.parametrize("backend,buckets,packed,route", [
    ("sdpa_segments", None, True, "sdpa_segments"),   # exact lengths, several groups
    ("sdpa_segments", 8, True, "sdpa_segments"),
    ("auto", 0, True, "sdpa_segments"),               # one group: what CUDA without a varlen kernel runs
    ("auto", None, False, "sdpa_segments"),           # a padded batch
    ("varlen", None, True, "flash"),                  # flash-attn's signature (its torch reference here)
])
def test_key_position_attention_equals_the_bias_form(backend, buckets, packed, route):
    torch.manual_seed(0)
    attn = RelPositionAttention(D, H, pos_enc="wenet", backend=backend).double()
    x = torch.randn(sum(LENS), D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(sum(LENS), D, dtype=torch.float64)
    if packed:
        layout, x_in = FrameLayout(LENS, "cpu", buckets_per_octave=buckets), x
        longest = bucket_length(max(LENS), buckets, max(LENS))
    else:   # padding rows hold garbage: nothing may read them
        layout = FrameLayout(LENS, "cpu", padded_len=45)
        x_in = torch.full((len(LENS) * 45, D), 7.0, dtype=torch.float64).index_copy(0, layout.real_rows(), x)
        longest = 45
    assert attn.route(x, layout) == route
    out = attn(x_in, layout, attn.positional(layout, relative_sinusoids(longest, D).double(), route))
    if not packed:
        out = out.index_select(0, layout.real_rows())

    def bias_form():
        q, k, v = (lin(x).view(-1, H, D // H) for lin in (attn.linear_q, attn.linear_k, attn.linear_v))
        p = attn.linear_pos(relative_sinusoids(max(LENS), D).double()).view(-1, H, D // H)
        o = rel_pos_reference(q + attn.pos_bias_u, k, v, q + attn.pos_bias_v, p, LENS, (D // H) ** -0.5,
                              key_positions=True)
        return attn.linear_out(o.flatten(1))

    want = bias_form()
    assert (out - want).abs().max() < 1e-10
    wrt = [x, attn.pos_bias_u, attn.pos_bias_v, attn.linear_pos.weight, attn.linear_q.weight, attn.linear_v.bias]
    got_g = torch.autograd.grad((out * w).sum(), wrt)
    want_g = torch.autograd.grad((want * w).sum(), wrt)
    for name, a, b in zip(("x", "u", "v", "W_pos", "W_q", "b_v"), got_g, want_g):
        assert (a - b).abs().max() < 1e-10 * max(1.0, b.abs().max().item()), name


def test_auto_gives_packed_wenet_rows_to_a_cu_seqlens_kernel(monkeypatch):
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    monkeypatch.setattr(conformer, "auto_backend", lambda device, dtype, dropout: (
        "torch_varlen" if device.type == "cuda" and dtype == bf16 and not dropout else "sdpa_segments"))
    assert encoder_backend("auto", cuda, packed=True, key_positions=True, dtype=bf16) == "torch_varlen"
    assert encoder_backend("auto", cuda, packed=False, key_positions=True, dtype=bf16) == "sdpa_segments"
    assert encoder_backend("auto", cuda, packed=True, key_positions=False, dtype=bf16) == "sdpa_segments"
    assert encoder_backend("auto", cuda, packed=True, key_positions=True) == "sdpa_segments"   # fp32: no kernel
    assert encoder_backend("auto", cuda, packed=True, dropout=0.1, key_positions=True, dtype=bf16) == "sdpa_segments"
    assert encoder_backend("sdpa_segments", cuda, packed=True, key_positions=True, dtype=bf16) == "sdpa_segments"
    assert encoder_backend("varlen", cpu, packed=True, key_positions=True) == "flash"   # asked for: the reference
    assert encoder_backend("varlen", cpu, packed=True, dropout=0.1, key_positions=True) == "sdpa_segments"


def test_route_follows_autocast(monkeypatch):
    """Under autocast the kernel is chosen for autocast's dtype, not the (fp32) input's."""
    seen = []
    monkeypatch.setattr(conformer, "auto_backend", lambda device, dtype, dropout: seen.append(dtype) or "sdpa_segments")
    attn = RelPositionAttention(D, H, pos_enc="wenet")
    layout = FrameLayout(LENS, "cpu")
    attn.route(torch.zeros(3, D), layout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn.route(torch.zeros(3, D), layout)
    assert seen == [torch.float32, torch.bfloat16]


def test_varlen_needs_key_positions():
    assert tiny_encoder(attn_backend="varlen", pos_enc="wenet").attn_backend == "varlen"
    with pytest.raises(ConfigError, match="model.encoder.attn_backend.*pos_enc wenet"):
        tiny_encoder(attn_backend="varlen")


def test_positions_restart_per_utterance_in_every_layout():
    packed = FrameLayout([3, 1, 2], "cpu", buckets_per_octave=0)
    assert packed.positions(grouped=False).tolist() == [0, 1, 2, 0, 0, 1]
    assert packed.positions(grouped=True).tolist() == [0, 1, 2] * 3   # one padded group of 3
    assert FrameLayout([3, 1, 2], "cpu", padded_len=4).positions(grouped=False).tolist() == [0, 1, 2, 3] * 3
    exact = FrameLayout([3, 1, 3], "cpu", buckets_per_octave=None)   # groups by length: [1], [3, 3]
    assert exact.positions(grouped=True).tolist() == [0, 0, 1, 2, 0, 1, 2]
