"""train.encoder_graphs on the CPU: the Conformer's blocks on rows padded to one static shape give
the real rows the same outputs and every weight and input the same gradients as the unpadded
packed run (what a captured graph then replays on CUDA); a batch that does not fit runs eagerly
and is counted. The cu_seqlens kernel route runs through flash-attn's torch reference here."""
import pytest
import torch

from west.models.conformer import ConformerEncoder
from west.models.static_encoder import StaticBlocks, StaticShape, padded_cu_seqlens

from helpers.e2e import tiny_encoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENS = [37, 100, 64, 15, 90, 23, 64, 7]


def encoder(seed: int = 0) -> ConformerEncoder:
    torch.manual_seed(seed)
    cfg = tiny_encoder(dropout=0.0, pos_enc="wenet", attn_backend="varlen", num_blocks=3)
    return ConformerEncoder(cfg).train()


def run(enc: ConformerEncoder, lens: list[int], seed: int = 1):
    """(real rows out, feats grad, {param: grad}) of a weighted sum of the packed output."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(sum(lens), 80, generator=g, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    enc.zero_grad(set_to_none=True)
    out, _ = enc(feats, cu_seqlens=cu)
    weights = torch.randn(out.shape, generator=g)
    (out * weights).sum().backward()
    return out.detach(), feats.grad, {n: p.grad.clone() for n, p in enc.named_parameters()}


def test_padded_blocks_equal_the_unpadded_run():
    enc = encoder()
    ref = run(enc, LENS)
    enc.static_blocks = StaticBlocks(enc, StaticShape(tokens=160, segments=16, max_seqlen=40), "flash")
    got = run(enc, LENS)
    assert enc.static_blocks.counts == {"static": 1}
    assert got[0].shape == ref[0].shape and torch.allclose(got[0], ref[0], atol=1e-5)
    real = got[0].shape[0]   # the real rows after subsampling, of the 160 the blocks computed
    assert enc.static_blocks.summary() == (f"1 encoder batches padded (eager) at 160 rows ({100 * real / 160:.0f} % "
                                           "of them real), 0 unpadded")
    assert torch.allclose(got[1], ref[1], atol=1e-5)
    assert ref[2].keys() == got[2].keys()
    for name in ref[2]:
        assert torch.allclose(got[2][name], ref[2][name], atol=1e-4, rtol=1e-4), name


def test_the_padding_is_what_the_blocks_see():
    """The static inputs: rows and boundaries at the shape, padding rows zero in segments of at
    most M, empty segments after them, and the gap index placing every row in its segment."""
    enc = encoder()
    static = StaticBlocks(enc, StaticShape(tokens=160, segments=16, max_seqlen=40), "flash")
    x = torch.randn(sum([10, 30]), 64)
    x_full, pos, cu, gap = static.inputs(x, [10, 30])
    assert x_full.shape == (160, 64) and pos.shape == (160, 64) and gap.shape == (160,)
    assert cu.tolist() == [0, 10, 40, 80, 120, 160] + [160] * 11
    assert torch.equal(x_full[:40], x) and not x_full[40:].any()
    pad = enc.blocks[0].conv.pad
    assert gap[:12].tolist() == list(range(10)) + [10 + pad, 11 + pad]
    assert torch.equal(pos[10], pos[40])   # each segment's first row: position 0
    # the padding rows' positions restart every M rows
    table = enc._pos_table(40, x)
    want = table.index_select(0, 39 - (torch.arange(static.shape.tokens - 40) % static.shape.max_seqlen))
    assert torch.equal(pos[40:], want)


@pytest.mark.parametrize("lens,shape,reason", [
    (LENS, StaticShape(tokens=80, segments=16, max_seqlen=40), "tokens"),
    (LENS, StaticShape(tokens=160, segments=16, max_seqlen=20), "max_seqlen"),
    (LENS, StaticShape(tokens=160, segments=9, max_seqlen=40), "segments")])
def test_a_batch_that_does_not_fit_runs_eagerly_and_is_counted(lens, shape, reason):
    enc = encoder()
    ref = run(enc, lens)
    enc.static_blocks = StaticBlocks(enc, shape, "flash")
    got = run(enc, lens)
    assert enc.static_blocks.counts == {f"eager: {reason}": 1}
    assert torch.equal(got[0], ref[0])
    assert enc.static_blocks.summary() == f"0 encoder batches padded (eager) at {shape.tokens} rows, 1 unpadded ({reason} 1)"


def test_only_training_with_gradients_and_the_kernel_route():
    enc = encoder()
    enc.static_blocks = StaticBlocks(enc, StaticShape(tokens=160, segments=16, max_seqlen=40), "flash")
    feats, cu = torch.randn(sum(LENS), 80), torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        enc(feats, cu_seqlens=cu)
    enc.eval()
    enc(feats, cu_seqlens=cu)
    assert not enc.static_blocks.counts
    with pytest.raises(ValueError, match="kernel route"):
        StaticBlocks(enc, StaticShape(tokens=160, segments=16, max_seqlen=40), "sdpa_segments")


def test_sample_inputs_are_padding_at_the_shape():
    enc = encoder()
    static = StaticBlocks(enc, StaticShape(tokens=160, segments=16, max_seqlen=40), "flash")
    x, pos, cu, gap = static.sample_inputs(torch.float32, torch.device("cpu"))
    assert x.shape == (160, 64) and x.requires_grad and not x.any()
    assert cu.shape == (17,) and gap.shape == (160,)
    out = static.stack(x, pos, cu, gap)
    out.sum().backward()
    assert out.shape == (160, 64) and x.grad is not None


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
    with pytest.raises(ValueError, match="cannot hold"):
        StaticShape(tokens=16, segments=3, max_seqlen=5)
