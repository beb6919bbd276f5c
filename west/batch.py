"""The batch that crosses from ``west.data`` to ``west.models``.

One structure serves every batch mode, so the model never guesses how samples
are laid out:

* ``static`` / ``dynamic``: ``input_ids`` is (B, L) with one sample per row,
  right-padded; ``cu_seqlens`` is None; encoder ``feats`` are padded (N, Tmax, 80).
* ``pack``: ``input_ids`` is (R, L) rows of at most ``pack_tokens`` (L = the
  longest row rounded up to ``pack_pad_multiple``, or exactly ``pack_tokens``),
  several samples per row. ``cu_seqlens`` (int32) gives segment boundaries over the
  flattened (R*L) tokens, including one dummy tail segment per row if the row
  is not full; ``position_ids`` restart at 0 for every segment. Encoder
  ``feats`` are concatenated (ΣT, 80) with their own ``feat_cu_seqlens``.
  With ``data.shared_prefix`` each row starts with the prompt prefix its samples
  share (one segment), the samples follow without it, their positions going on
  from the prefix's length, and ``key_index`` / ``key_cu_seqlens`` give every
  segment its keys: the row's prefix, then its own rows.

``speech_spans`` row i = (row, start, length) says where speech segment i
(the i-th entry of ``feats``) is spliced into the LLM input; ``length`` equals
``west.shapes.num_speech_tokens(feat_lens[i])``. ``ctc_targets`` holds, in the
same segment order, the token ids of what each segment says (for the optional
CTC loss on the encoder); a segment with no known transcript has length 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import numpy as np
import torch

IGNORE_INDEX = -100

# Counter names every batch carries (ints), summed by the trainer per step.
COUNTER_NAMES = (
    "utterances",          # samples (utterances or conversations) in the batch
    "label_tokens",        # LLM positions with a label != IGNORE_INDEX
    "real_llm_tokens",     # LLM positions that belong to a sample
    "computed_llm_tokens", # LLM positions the model computes (incl. padding/tail)
    "real_enc_frames",     # fbank frames that belong to an utterance
    "computed_enc_frames", # fbank frames the encoder computes (incl. padding)
)


@dataclass
class Batch:
    input_ids: torch.Tensor                      # (R, L) int64
    labels: torch.Tensor                         # (R, L) int64, IGNORE_INDEX where no loss
    position_ids: torch.Tensor                   # (R, L) int64, restart per sample
    feats: Optional[torch.Tensor] = None         # (N, Tmax, F) padded or (ΣT, F) packed; None if no speech
    feat_lens: Optional[torch.Tensor] = None     # (N,) int64 fbank frames per speech segment
    speech_spans: Optional[torch.Tensor] = None  # (N, 3) int64: (row, start, length)
    attention_mask: Optional[torch.Tensor] = None    # (R, L) 1 = real token; padded modes only
    cu_seqlens: Optional[torch.Tensor] = None        # (S+1,) int32 over flattened tokens; pack only
    max_seqlen: Optional[int] = None
    feat_cu_seqlens: Optional[torch.Tensor] = None   # (N+1,) int32 over ΣT; packed encoder only
    feat_max_len: Optional[int] = None
    # pack rows that start with the samples' shared prompt prefix (data.shared_prefix): each segment's
    # keys, gathered from these flat rows, with boundaries of their own (west.models.shared_prefix)
    key_index: Optional[torch.Tensor] = None         # (rows_k,) int64
    key_cu_seqlens: Optional[torch.Tensor] = None    # (S+1,) int32 over the gathered keys
    key_max_seqlen: Optional[int] = None
    ctc_targets: Optional[torch.Tensor] = None       # (Σ K,) int64 transcript ids of every speech segment
    ctc_target_lens: Optional[torch.Tensor] = None   # (N,) int64 K per segment; 0 = no transcript
    keys: list = field(default_factory=list)         # sample keys, in sample order
    counters: dict = field(default_factory=dict)     # COUNTER_NAMES -> int
    source: Optional["Batch"] = field(default=None, repr=False, compare=False)  # the host batch of a moved one

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def encoder_packed(self) -> bool:
        return self.feat_cu_seqlens is not None

    def encoder_inputs(self) -> dict:
        """``encoder.forward_flat``'s keyword for these feats, read from the host batch: the packed
        boundaries (``cu_seqlens``) or the padded lengths (``lengths``)."""
        host = self.host
        return {"cu_seqlens": host.feat_cu_seqlens} if self.encoder_packed else {"lengths": host.feat_lens}

    @property
    def host(self) -> "Batch":
        """This batch with its tensors where the loader made them (the CPU): lengths, spans and
        boundaries are read from here, so the model never waits on the device to learn a shape."""
        return self.source if self.source is not None else self

    def to(self, device: torch.device | str) -> "Batch":
        """Every tensor on ``device`` (cu_seqlens included; keys/counters stay), copied without
        a host sync (:func:`to_device`); the result keeps this batch as its :attr:`host`."""
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "source":
                moved[f.name] = to_device(v, device) if isinstance(v, torch.Tensor) else v
        return Batch(**moved, source=self.host)

    def pin_memory(self) -> "Batch":
        """Page-locked copies of the tensors (DataLoader(pin_memory=True) calls this in its pin thread)."""
        pinned = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "source":
                pinned[f.name] = v.pin_memory() if isinstance(v, torch.Tensor) else v
        return Batch(**pinned)

    def label_positions(self) -> torch.Tensor:
        """(n_labels,) int64 flat positions of ``labels`` that carry a label, computed on the host copy."""
        return (self.host.labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def host_to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host-built numpy index array as a tensor on ``device`` (:func:`to_device`). Index
    arithmetic done in numpy costs microseconds per batch and dispatches no tensor operators."""
    return to_device(torch.from_numpy(np.ascontiguousarray(a)), device)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device`` without stalling the host: a CPU tensor bound for CUDA is page-locked
    (when it is not already) and copied non-blocking, so the copy queues behind the kernels
    already launched instead of waiting for them. Elsewhere a plain ``.to``. Host-built index tensors reach the GPU only through here (tests
    count the copies)."""
    device = torch.device(device)
    if t.device == device or device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if t.is_pinned():
        return t.to(device, non_blocking=True)
    return t.pin_memory().to(device, non_blocking=True)
