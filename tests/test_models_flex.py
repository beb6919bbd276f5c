"""FlexAttention for packed rows (west.models.flex): the block structure built from lengths alone,
and the Conformer's relative-position term as a score_mod, against segment SDPA and float64.

On the CPU torch runs FlexAttention forward only (no backward); the gradients are checked on
a GPU by tools/check_attention_cuda.py (tools/gpu_suite.sh)."""
import pytest
import torch

from west.models.attention import LazySegmentPlan, reference_attention, varlen_attention
from west.models.conformer import ConformerEncoder, attention_grouping, encoder_backend, relative_sinusoids
from west.models.flex import DocumentMask, document_blocks, rel_pos_attention, rel_pos_reference

from helpers.e2e import tiny_encoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = [[5, 200, 51, 128, 3], [128, 128, 256], [1], [300], [7, 0, 9, 140, 2, 2, 2, 260], [129, 127]]


def _blocks(table):
    counts, idx = table
    return [sorted(idx[0, 0, i, :int(counts[0, 0, i])].tolist()) for i in range(counts.shape[-1])]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_document_blocks_equal_create_block_mask(lengths, causal):
    """The tiles built from the boundaries are exactly those torch finds by evaluating the dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    cu = torch.tensor([0] + lengths).cumsum(0)
    rows = int(cu[-1])
    doc = torch.searchsorted(cu[1:], torch.arange(rows), right=True)

    def mask_mod(b, h, q, k):
        same = doc[q] == doc[k]
        return same & (q >= k) if causal else same

    want = create_block_mask(mask_mod, None, None, rows, rows, device="cpu")
    got = document_blocks(lengths, 128, causal)
    assert _blocks(got[:2]) == _blocks((want.kv_num_blocks, want.kv_indices))
    assert _blocks(got[2:]) == _blocks((want.full_kv_num_blocks, want.full_kv_indices))


@pytest.mark.parametrize("key_positions", [False, True])
def test_rel_pos_score_mod_equals_reference(key_positions):
    torch.manual_seed(0)
    lengths, h, d = [5, 140, 33, 1, 90], 4, 8
    rows, m = sum(lengths), 150
    q, k, v, qv = (torch.randn(rows, h, d) for _ in range(4))
    pos_proj = torch.randn(2 * m - 1, h, d)
    with torch.no_grad():
        got = rel_pos_attention(q, k, v, qv, pos_proj, DocumentMask(lengths, "cpu"), 0.35, key_positions)
    want = rel_pos_reference(*(t.double() for t in (q, k, v, qv, pos_proj)), lengths, 0.35, key_positions)
    assert (got.double() - want).norm() / want.norm() < 1e-5


@pytest.mark.parametrize("pos_enc", ["relative", "wenet"])
def test_conformer_flex_forward_equals_segment_sdpa(pos_enc):
    """The whole packed Conformer with attn_backend flex gives segment SDPA's output (forward)."""
    torch.manual_seed(0)
    cfg = tiny_encoder(dropout=0.0, pos_enc=pos_enc, num_blocks=2)
    enc = ConformerEncoder(cfg).eval()
    lens = [40, 400, 123, 9, 260]
    feats = torch.randn(sum(lens), cfg.input_dim)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    outs = {}
    for backend in ("sdpa_segments", "flex"):
        for block in enc.blocks:
            block.attn.backend = backend
        with torch.no_grad():
            outs[backend] = enc(feats, cu_seqlens=cu)[0]
    rel = (outs["flex"] - outs["sdpa_segments"]).norm() / outs["sdpa_segments"].norm()
    assert rel < 1e-5, rel


def test_llm_flex_backend_uses_the_batch_mask_and_matches_reference():
    torch.manual_seed(1)
    lengths = [20, 130, 7, 300]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    q, k, v = torch.randn(sum(lengths), 6, 16), torch.randn(sum(lengths), 2, 16), torch.randn(sum(lengths), 2, 16)
    plan = LazySegmentPlan(cu)
    with torch.no_grad():
        got = varlen_attention(q, k, v, cu, max(lengths), causal=True, backend="flex", plan=plan)
    want = reference_attention(q, k, v, cu, causal=True)
    assert (got.double() - want).norm() / want.norm() < 1e-5
    assert True in plan._masks   # the causal document mask was built once, from the host boundaries


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert encoder_backend("auto", cpu, packed=True) == "sdpa_segments"
    assert encoder_backend("auto", cuda, packed=True) == "sdpa_segments"      # measured faster than flex (H100)
    assert encoder_backend("flex", cuda, packed=True) == "flex"
    assert encoder_backend("flex", cuda, packed=False) == "sdpa_segments"     # one padded group
    assert encoder_backend("flex", cuda, packed=True, dropout=0.1) == "sdpa_segments"
    assert encoder_backend("sdpa_segments", cuda, packed=True) == "sdpa_segments"
    with torch.no_grad():
        assert encoder_backend("flex", cpu, packed=True) == "flex"               # forward runs on the CPU
    assert encoder_backend("flex", cpu, packed=True) == "sdpa_segments"         # training does not


def test_auto_groups_packed_attention_in_one_group_on_cuda_only():
    """On CUDA, ``auto`` runs every packed segment in one SDPA group (a fixed kernel count per layer);
    elsewhere, and for an explicit backend, the configured buckets_per_octave."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = tiny_encoder(buckets_per_octave=8)
    assert attention_grouping(auto, cuda) == 0
    assert attention_grouping(auto, cpu) == 8
    assert attention_grouping(tiny_encoder(buckets_per_octave=8, attn_backend="sdpa_segments"), cuda) == 8
    assert attention_grouping(tiny_encoder(buckets_per_octave=None, attn_backend="flex"), cuda) is None
    assert ConformerEncoder(auto).attention_buckets == 8                      # its weights are on the CPU


def test_positional_table_must_cover_the_longest_document():
    q = torch.randn(30, 2, 4)
    table = torch.randn(2 * 10 - 1, 2, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="longest document"):
        rel_pos_attention(q, q, q, q, table, DocumentMask([30], "cpu"), 1.0)
    assert relative_sinusoids(4, 8).shape == (7, 8)
