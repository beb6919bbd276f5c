"""The Conformer gives each utterance the same output (and gradients) whether it runs
alone, in a padded batch or packed with others."""
import pytest
import torch

from west.models.config import ConformerConfig
from west.models.conformer import ConformerEncoder, relative_sinusoids
from west.models.layout import FrameLayout, depthwise_conv1d
from west.shapes import min_fbank_frames, subsampled_frames

from helpers.e2e import tiny_encoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENS = [37, 100, 64, 15, 90, 23, 64, 7]
TOL = 1e-5


def _encoder(rate=4, bpo=8, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = tiny_encoder(dropout=0.0, subsampling_rate=rate, buckets_per_octave=bpo, **kw)
    return ConformerEncoder(cfg).eval()


def _feats(lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 80, generator=g) for n in lens]


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _pad(feats, extra=0):
    out = torch.zeros(len(feats), max(len(f) for f in feats) + extra, 80)
    for i, f in enumerate(feats):
        out[i, : len(f)] = f
    return out


@pytest.mark.parametrize("rate,bpo,pos_enc,backend", [
    (4, 8, "relative", "auto"), (6, None, "relative", "auto"), (8, 2, "relative", "auto"),
    (4, 8, "wenet", "auto"), (6, None, "wenet", "auto"),
    (4, 0, "relative", "auto"), (4, 0, "wenet", "auto"),   # 0: CUDA's auto grouping
    (4, 8, "wenet", "varlen")])                            # packed rows through flash-attn's signature
def test_packed_equals_alone_equals_padded(rate, bpo, pos_enc, backend):
    lens = [n for n in LENS if n >= min_fbank_frames(rate)]
    enc, feats = _encoder(rate, bpo, pos_enc=pos_enc, attn_backend=backend), _feats(lens)
    with torch.no_grad():
        alone = [enc(f[None], lengths=torch.tensor([len(f)]))[0][0] for f in feats]
        packed, cu = enc(torch.cat(feats), cu_seqlens=_cu(lens))
        padded, out_lens = enc(_pad(feats, extra=9), lengths=torch.tensor(lens))
    assert [a.shape[0] for a in alone] == [subsampled_frames(n, rate) for n in lens]
    assert torch.diff(cu).tolist() == out_lens.tolist() == [a.shape[0] for a in alone]
    assert cu.dtype == torch.int32
    for i, a in enumerate(alone):
        assert (packed[cu[i]: cu[i + 1]] - a).abs().max() <= TOL
        assert (padded[i, : out_lens[i]] - a).abs().max() <= TOL


@pytest.mark.parametrize("bpo,pos_enc,backend", [(8, "relative", "auto"), (None, "relative", "auto"),
                                             (0, "relative", "auto"), (0, "wenet", "auto"), (8, "wenet", "varlen")])
def test_gradients_packed_alone_padded_agree(bpo, pos_enc, backend):
    """Also what west.models.layout.gather_rows relies on: attention padding rows get no gradient."""
    enc, feats = _encoder(bpo=bpo, pos_enc=pos_enc, attn_backend=backend), _feats(LENS)
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(subsampled_frames(n, 4), 64, generator=g) for n in LENS]
    params = [p for p in enc.parameters()]

    def run(mode):
        xs = [f.clone().requires_grad_() for f in feats]
        if mode == "alone":
            loss = sum((enc(x[None], lengths=torch.tensor([len(x)]))[0][0] * w).sum() for x, w in zip(xs, weights))
        elif mode == "packed":
            out, _ = enc(torch.cat(xs), cu_seqlens=_cu(LENS))
            loss = (out * torch.cat(weights)).sum()
        else:
            out, lens = enc(torch.stack([torch.nn.functional.pad(x, (0, 0, 0, 100 - len(x))) for x in xs]),
                            lengths=torch.tensor(LENS))
            loss = sum((out[i, :n] * w).sum() for i, (n, w) in enumerate(zip(lens.tolist(), weights)))
        grads = torch.autograd.grad(loss, xs + params)
        return grads[: len(xs)], grads[len(xs):]

    ref_x, ref_p = run("alone")
    for mode in ("packed", "padded"):
        gx, gp = run(mode)
        for a, b in zip(gx, ref_x):
            assert (a - b).abs().max() <= TOL, mode
        for a, b, p in zip(gp, ref_p, params):
            assert (a - b).abs().max() <= TOL * max(1.0, b.abs().max().item()), (mode, p.shape)


def test_no_leak_between_packed_utterances():
    enc, feats = _encoder(), _feats(LENS)
    with torch.no_grad():
        out, cu = enc(torch.cat(feats), cu_seqlens=_cu(LENS))
        feats[3] = feats[3] * 10 + 1
        out2, _ = enc(torch.cat(feats), cu_seqlens=_cu(LENS))
    for i in range(len(LENS)):
        same = torch.equal(out[cu[i]: cu[i + 1]], out2[cu[i]: cu[i + 1]])
        assert same == (i != 3)


def test_dropout_configurable_and_off_in_eval():
    enc = ConformerEncoder(tiny_encoder(dropout=0.5))
    x = torch.randn(50, 80)
    enc.train()
    a, _ = enc(x, cu_seqlens=_cu([50]))
    b, _ = enc(x, cu_seqlens=_cu([50]))
    assert not torch.equal(a, b)
    enc.eval()
    with torch.no_grad():
        assert torch.equal(enc(x, cu_seqlens=_cu([50]))[0], enc(x, cu_seqlens=_cu([50]))[0])


def test_each_branch_passes_through_dropout_once_as_in_wenet():
    """WeNet's block applies its dropout once to each branch's output (and the feed-forwards once
    inside): the conv module has no dropout of its own, so in training it is deterministic."""
    enc = ConformerEncoder(tiny_encoder(dropout=0.5)).train()
    calls = []
    for name, m in enc.named_modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_hook(lambda mod, args, out, name=name: calls.append(name))
    enc(torch.randn(50, 80), cu_seqlens=_cu([50]))
    per_block = [c.split(".", 2)[2] for c in calls if c.startswith("blocks.0.")]
    assert sorted(per_block) == ["dropout"] * 4 + ["ff1.net.2", "ff2.net.2"]   # 4 branches, 2 inner
    assert len(calls) == 1 + 6 * len(enc.blocks)   # and the subsampling's
    conv, x = enc.blocks[0].conv, torch.randn(50, 64)
    layout = FrameLayout([50], x.device)
    assert torch.equal(conv(x, layout), conv(x, layout))


def test_rejects_too_short_and_bad_inputs():
    enc = _encoder()
    with pytest.raises(ValueError, match="too short"):
        enc(torch.randn(5, 80), cu_seqlens=_cu([5]))
    with pytest.raises(ValueError, match="exactly one"):
        enc(torch.randn(50, 80))
    with pytest.raises(ValueError, match="cover"):
        enc(torch.randn(50, 80), cu_seqlens=_cu([20, 20]))


def test_conv_layout_gap_is_per_utterance():
    layout = FrameLayout([3, 1, 4], "cpu")
    x = torch.arange(1, 9, dtype=torch.float32)[:, None]
    buf = layout.conv_in(x, pad=2)
    assert buf.shape == (1, 1, 8 + 2 * 2)
    assert buf[0, 0].tolist() == [1, 2, 3, 0, 0, 4, 0, 0, 5, 6, 7, 8]
    kernel = torch.ones(1, 1, 5)
    y = layout.conv_out(torch.nn.functional.conv1d(buf, kernel, padding=2), pad=2)
    assert y[:, 0].tolist() == [6, 6, 6, 4, 18, 26, 26, 21]
    conv = torch.nn.Conv1d(1, 1, 5, bias=False)
    conv.weight.data.fill_(1.0)
    assert layout.convolve(x, conv)[:, 0].tolist() == [6, 6, 6, 4, 18, 26, 26, 21]


def test_relative_sinusoids_centre_is_length_independent():
    big, small = relative_sinusoids(50, 16), relative_sinusoids(7, 16)
    assert torch.allclose(big[50 - 7: 50 + 6], small)
    assert torch.allclose(small[6], torch.tensor([0.0, 1.0] * 8))  # distance 0


def test_default_encoder_is_the_aishell_size():
    n = sum(p.numel() for p in ConformerEncoder(ConformerConfig()).parameters())
    assert 30e6 < n < 45e6


@pytest.mark.parametrize("rate", [4, 6, 8])
@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("packed", [True, False])
def test_chunked_subsampling_equals_whole_images(rate, chunk, packed):
    """The conv input (the packed buffer, or each padded utterance) is convolved in overlapping
    chunks: same frames, same gradients as one whole image each."""
    from torch.nn.utils.rnn import pad_sequence

    from west.models.subsampling import Conv2dSubsampling, receptive_field

    lens = [n for n in LENS if n >= min_fbank_frames(rate)] + [8 * 40]   # one of >= 40 outputs
    torch.manual_seed(0)
    sub = Conv2dSubsampling(80, 16, rate, chunk_frames=0)
    feats = (torch.cat(_feats(lens)) if packed else pad_sequence(_feats(lens), batch_first=True)).requires_grad_(True)
    results = []
    for frames in (0, chunk):
        sub.chunk_frames = frames
        y, layout = sub.forward_packed(feats, lens) if packed else sub.forward_padded(feats, lens)
        (grad,) = torch.autograd.grad((y * torch.arange(y.numel()).view_as(y).sin()).sum(), feats)
        results.append((y.detach(), grad, layout.lengths))
    (y0, g0, l0), (y1, g1, l1) = results
    assert l0 == l1 == [subsampled_frames(n, rate) for n in lens]
    assert (sum(l0) if packed else max(l0)) > chunk    # really several chunks per image
    assert (y0 - y1).abs().max() <= 1e-5 and (g0 - g1).abs().max() <= 1e-5
    assert receptive_field(rate) == {4: 7, 6: 11, 8: 15}[rate]


def test_depthwise_conv_as_shifted_products_equals_the_conv_kernel():
    """What compiled blocks run instead of the convolution kernel: same values and gradients."""
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(6, 6, 7, groups=6)
    x = torch.randn(3, 6, 20, requires_grad=True)
    want = torch.nn.functional.conv1d(x, conv.weight, conv.bias, padding=3, groups=6)
    got = depthwise_conv1d(x, conv)
    torch.testing.assert_close(got, want)
    w = torch.randn_like(want)
    g_want = torch.autograd.grad((want * w).sum(), [x, conv.weight, conv.bias])
    g_got = torch.autograd.grad((got * w).sum(), [x, conv.weight, conv.bias])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="depthwise"):
        depthwise_conv1d(torch.randn(1, 4, 10), torch.nn.Conv1d(4, 4, 3))
