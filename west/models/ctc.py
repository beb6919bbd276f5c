"""CTC over the speech segments of a batch, each against its own transcript."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from west.batch import to_device
from west.models.projector import group_frames


def segment_ctc(logits: torch.Tensor, frames: Sequence[int], target_lens: Sequence[int],
                targets: Sequence[int], blank: int) -> tuple[torch.Tensor, int, int]:
    """(summed CTC, segments with a transcript, infeasible segments).

    ``logits`` (Σ frames, C) hold the segments end to end; ``targets`` their transcripts
    end to end (``target_lens`` each, 0 = no transcript: left out). A transcript of K tokens
    with R adjacent repeats needs K + R frames; a segment with fewer adds 0 (zero_infinity)
    and is counted as infeasible."""
    keep, tgt, need, offset = [], [], [], 0
    for i, k in enumerate(target_lens):
        t = list(targets[offset:offset + k])
        offset += k
        if k:
            keep.append(i)
            tgt += t
            need.append(k + sum(a == b for a, b in zip(t, t[1:])))
    dev = logits.device
    kept = [frames[i] for i in keep]
    if len(keep) < len(frames):   # only the frames of segments with a transcript
        starts = torch.tensor([0] + list(frames[:-1])).cumsum(0)
        rows = to_device(torch.cat([torch.arange(int(starts[i]), int(starts[i]) + frames[i]) for i in keep]), dev)
        logits = logits.index_select(0, rows)
    logp = F.log_softmax(logits.float(), dim=-1)
    # (T, N, C) zero-padded: grouping by the longest segment gives one zero-filled row per
    # segment, in one index_copy (a per-segment slice copy costs an autograd node each)
    per_seg = group_frames(logp, kept, max(kept)).transpose(0, 1)
    # lengths stay on the host (ctc_loss reads them there); the targets travel without a sync
    losses = F.ctc_loss(per_seg, to_device(torch.tensor(tgt), dev), torch.tensor(kept),
                        torch.tensor([target_lens[i] for i in keep]),
                        blank=blank, reduction="none", zero_infinity=True)
    infeasible = sum(frames[i] < k for i, k in zip(keep, need))
    return losses.sum(), len(keep), infeasible
