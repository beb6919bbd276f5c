"""Scored segment attention (softcap, window, sinks per segment) against a dense float64
reference over the block-diagonal mask, with segments of several lengths padded inside their
groups, grouped key/value heads, causal and bidirectional."""
from __future__ import annotations

import pytest
import torch

from west.models.attention import SegmentPlan
from west.models.scored_attention import scored_segment_attention

LENGTHS = [5, 17, 9, 1, 12]


def dense(q, k, v, lengths, causal, softcap, window, sinks):
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    start = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)[doc]
    pos = torch.arange(len(doc)) - start
    allowed = doc[:, None] == doc[None, :]
    dist = pos[:, None] - pos[None, :]
    if causal:
        allowed &= dist >= 0
    if window is not None:
        allowed &= dist < window
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, s.shape[1], 1)], -1)
    p = s.softmax(-1)[..., :s.shape[-1] - (sinks is not None)]
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("softcap, window, sinks", [(None, None, None), (1.5, None, None), (None, 4, None),
                                                    (None, None, True), (1.5, 4, True)])
def test_matches_the_dense_reference_and_each_term_matters(causal, softcap, window, sinks):
    g = torch.Generator().manual_seed(0)
    rows = sum(LENGTHS)
    q, k, v = (torch.randn(rows, h, 8, generator=g) * 2 for h in (4, 2, 2))
    sink = torch.randn(4, generator=g) if sinks else None
    plan = SegmentPlan.from_lengths(LENGTHS, buckets_per_octave=2)   # padded groups: 17 and 12 share one
    assert any(gr.valid is not None for gr in plan.groups)
    got = scored_segment_attention(q, k, v, plan, causal=causal, softcap=softcap, window=window, sinks=sink)
    want = dense(q, k, v, LENGTHS, causal, softcap, window, sink)
    assert torch.allclose(got.double(), want, atol=1e-5)
    if softcap or window or sinks:   # the reference without the terms is far from it
        assert not torch.allclose(dense(q, k, v, LENGTHS, causal, None, None, None), want, atol=1e-2)


def test_bad_settings_are_refused():
    plan = SegmentPlan.from_lengths([3])
    q = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="window"):
        scored_segment_attention(q, q, q, plan, window=0)
    with pytest.raises(ValueError, match="softcap"):
        scored_segment_attention(q, q, q, plan, softcap=0.0)
