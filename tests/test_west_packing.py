"""west.packing, the functional API: layout, labels, boundaries and the error cases."""
from __future__ import annotations

import pytest
import torch

from west.packing import IGNORE, concatenate_and_pack, pack, pack_sequences

SEQS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12]]


def test_pack_sequences_rows_positions_boundaries_and_labels():
    packed, bounds = pack_sequences(SEQS, max_length=8, pad_token_id=0, return_boundaries=True)
    assert packed.input_ids.shape == (2, 8) and bounds == packed.boundaries
    seen = []
    for r, row in enumerate(bounds):
        for i, start, end in row:
            seen.append(i)
            assert packed.input_ids[r, start:end].tolist() == SEQS[i]
            assert packed.position_ids[r, start:end].tolist() == list(range(end - start))
            # the label at a sample's first token is never a target: the previous sample would predict it
            assert packed.labels[r, start:end].tolist() == [IGNORE] + SEQS[i][1:]
        used = row[-1][2]
        assert (packed.input_ids[r, used:] == 0).all() and (packed.labels[r, used:] == IGNORE).all()
    assert sorted(seen) == [0, 1, 2, 3]
    cu = packed.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == 16 and packed.cu_seqlens.dtype == torch.int32
    segments = [b - a for a, b in zip(cu, cu[1:])]
    assert packed.max_seqlen == max(segments) and sum(segments) == 16
    assert packed.padding_share == pytest.approx(4 / 16)


def test_pack_sequences_accepts_tensors_and_labels():
    labels = [[-100, 2, 3], [4, -100], [6, 7, 8, 9], [10, 11, 12]]
    packed = pack_sequences([torch.tensor(s) for s in SEQS], 8, 0, labels=labels)
    for r, row in enumerate(packed.boundaries):
        for i, start, end in row:
            assert packed.labels[r, start:end].tolist() == [IGNORE] + labels[i][1:]


def test_concatenate_and_pack_drops_masked_padding():
    inputs = [[1, 2, 3, 0, 0], [4, 5, 6, 7]]
    labels = [[-100, 2, 3, -100, -100], [-100, -100, 6, 7]]
    masks = [[1, 1, 1, 0, 0], [1, 1, 1, 1]]
    packed = concatenate_and_pack(inputs, labels, masks, max_length=8, pad_token_id=0)
    assert packed.input_ids.shape == (1, 8)
    row = {i: (s, e) for i, s, e in packed.boundaries[0]}
    assert packed.input_ids[0, slice(*row[0])].tolist() == [1, 2, 3]
    assert packed.labels[0, slice(*row[1])].tolist() == [-100, -100, 6, 7]


def test_pack_is_the_planner():
    bins = pack([len(s) for s in SEQS], 8)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3] and all(
        sum(len(SEQS[i]) for i in b) <= 8 for b in bins)


@pytest.mark.parametrize("call,match", [
    (lambda: pack_sequences([], 8, 0), "no sequences"),
    (lambda: pack_sequences([[1, 2], [1] * 9], 8, 0), r"sequences\[1\] has 9 tokens, more than max_length 8"),
    (lambda: pack_sequences([[1], []], 8, 0), r"sequences\[1\] is empty"),
    (lambda: pack_sequences(SEQS, 8, -1), "pad_token_id"),
    (lambda: pack_sequences(SEQS, 8, None), "pad_token_id"),
    (lambda: pack_sequences(SEQS, 8, True), "pad_token_id"),
    (lambda: pack_sequences(SEQS, 8, 0, labels=[[1]]), "label sequences"),
    (lambda: concatenate_and_pack([[1, 2]], [[1, 2]], [[1]], max_length=8, pad_token_id=0), r"masks\[0\]"),
    (lambda: concatenate_and_pack([[1, 2]], [[1, 2]], [[0, 0]], max_length=8, pad_token_id=0), "empty"),
])
def test_errors_name_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call()
