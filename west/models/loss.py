"""Summed cross-entropy of a linear head over a large vocabulary, without the (N, V) logits.

SpeechLLM's loss is CE(h @ W.T (+ b), target) summed over the label rows, plus the count of
rows whose argmax is the target. With Qwen2's 151,936 tokens, 1,500 label rows give 0.9 GB of
float32 logits, their bf16 copy and their gradient. :func:`linear_cross_entropy` computes the
same two numbers chunk by chunk (``impl="chunked"``), so at most one chunk of logits exists at
a time.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from west.models.config import LOSS_IMPLS
from west.models.precision import accumulation_dtype, autocast_dtype, autocast_on

W_GRAD_ROWS = 16384   # vocabulary rows per product of W's gradient (a 50 MB bf16 temporary at H 1,536)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         bias: torch.Tensor | None = None, chunk_rows: int = 512,
                         impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """-> (loss_sum: 0-d float32 tensor, summed CE over rows; n_correct: 0-d int64 tensor, rows
    whose argmax == target). Float64 inputs give a float64 loss (for gradcheck).

    ``hidden`` (N, H), ``weight`` (V, H), ``target`` (N,) class ids in [0, V) (no ignore
    index: select the label rows first), ``bias`` (V,) or None. The logits are computed as
    ``F.linear`` would be: under autocast for the tensors' device, in the autocast dtype, then
    upcast to float32 for the softmax, as ``F.cross_entropy(F.linear(...).float())`` does.

    ``impl``:
    * ``"chunked"``: the logits in chunks of at most ``chunk_rows`` rows x V, each over the
      whole vocabulary. When a gradient is wanted (grad mode on and an input requiring it),
      each chunk's (softmax - one_hot) goes into the gradients of h, W and b in the forward
      itself, and the backward only scales them by its ``grad_loss``: no logits are recomputed.
      The extra memory is about one chunk (its float32 and autocast-dtype copies), h's float32
      gradient and, when W trains, W's float32 gradient; W's gradient matmul is skipped when W
      does not require grad. Under autocast the (softmax - one_hot) chunk is rounded to bf16
      before ``grad_loss`` scales it (plain rounds after), a difference within bf16 rounding.
      The default 512 x 151,936 is a 0.3 GB float32 chunk.
    * ``"plain"``: the reference, all N x V logits at once.
    * ``"auto"``: chunked. On one H200 at the seed's shapes (frozen 151,936 x 1,536 head, bf16,
      1,500 label rows) its forward + backward took 5.2 ms, as plain's 5.1 (Liger-Kernel's fused
      loss took 25.4 and cut-cross-entropy's 9.8: docs/benchmarks.md).

    N == 0 gives zeros whose graph still reaches ``hidden``, ``weight`` and ``bias`` (zero
    gradients), so DDP sees every parameter used on a batch without labels.
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {LOSS_IMPLS}")
    target = _checked_target(hidden, weight, target, bias, chunk_rows)
    if impl == "auto":
        impl = "chunked"
    if hidden.shape[0] == 0:
        return _empty(hidden, weight, bias)
    if impl == "chunked":
        want_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
        return _ChunkedLinearCE.apply(hidden, weight, bias, target, chunk_rows, _compute_dtype(hidden, weight),
                                      want_grad)
    return _plain(hidden, weight, target, bias)


# ---------------------------------------------------------------- checks and dtypes
def _checked_target(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                    bias: torch.Tensor | None, chunk_rows: int) -> torch.Tensor:
    """``target`` as int64 after the shape, dtype and range checks (the bad index named)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (N, H); got shape {tuple(hidden.shape)}")
    n, h = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != h:
        raise ValueError(f"weight must be (V, {h}) for hidden {tuple(hidden.shape)}; got {tuple(weight.shape)}")
    v = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (v,):
        raise ValueError(f"bias must be ({v},); got {tuple(bias.shape)}")
    if tuple(target.shape) != (n,):
        raise ValueError(f"target must be ({n},), one class id per hidden row; got {tuple(target.shape)}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"target must hold integer class ids; got dtype {target.dtype}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int; got {chunk_rows!r}")
    if n and target.device.type == "cpu":   # a device target is the caller's to check (on its host copy)
        bad = (target < 0) | (target >= v)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"target[{i}] = {int(target[i])} is outside the vocabulary [0, {v}) "
                             f"({int(bad.sum())} such rows; ignored positions must be removed before the loss)")
    return target.long()


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in here: the autocast dtype when autocast
    is on for the device (float64 is never autocast), else the tensors' own dtype."""
    cast = autocast_dtype(hidden, weight)
    if cast is not None:
        return cast
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype} (outside autocast they must match)")
    return hidden.dtype


def _no_autocast(t: torch.Tensor):
    """Run with the dtypes chosen here (autocast would re-cast inside the Function)."""
    dev = t.device.type
    return torch.autocast(dev, enabled=False) if autocast_on(dev) else nullcontext()


def _empty(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """Zero loss for N == 0 that still backprops (zero) gradients into every input."""
    loss = hidden.sum() + weight[:0].sum()
    if bias is not None:
        loss = loss + bias[:0].sum()
    dtype = accumulation_dtype(torch.promote_types(hidden.dtype, weight.dtype))
    return loss.to(dtype), torch.zeros((), dtype=torch.int64, device=hidden.device)


# ---------------------------------------------------------------- implementations
def _plain(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
           bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: every label row's logits at once."""
    _compute_dtype(hidden, weight)   # same dtype rule (and error) as the other paths
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(accumulation_dtype(logits.dtype))
    loss = F.cross_entropy(logits, target, reduction="sum")
    return loss, (logits.detach().argmax(-1) == target).sum()


class _ChunkedLinearCE(torch.autograd.Function):
    """Row chunk by row chunk, each over the whole vocabulary: the chunk's logits, their
    logsumexp, target logit and argmax. When a gradient is wanted, the same pass turns the
    chunk's exponentials in place into (softmax - one_hot) and multiplies them into the
    gradients of h, W and b: the loss ends the graph, so only ``grad_loss`` is unknown, and the
    backward scales the kept gradients by it instead of recomputing any logits (two matmuls
    per chunk instead of three, and the float32 chunk is swept by a few kernels once, not twice)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, chunk_rows: int, cd: torch.dtype, want_grad: bool):
        acc = accumulation_dtype(cd)
        n, dev = hidden.shape[0], hidden.device
        need_h, need_w, need_b = (want_grad and x for x in ctx.needs_input_grad[:3])
        loss = torch.zeros((), dtype=acc, device=dev)
        correct = torch.zeros((), dtype=torch.int64, device=dev)
        grad_h = torch.empty(hidden.shape, dtype=accumulation_dtype(hidden.dtype), device=dev) if need_h else None
        grad_w = grad_b = None   # summed over the chunks, starting from the first chunk's
        with _no_autocast(hidden):
            h_all, w = hidden.to(cd), weight.to(cd)
            b = None if bias is None else bias.to(cd)
            for r0 in range(0, n, chunk_rows):
                h, t = h_all[r0:r0 + chunk_rows], target[r0:r0 + chunk_rows]
                x = F.linear(h, w, b)                     # (rows, V) in cd, as F.linear under autocast
                top, arg = x.max(-1)                      # exact in cd; ties give the first index
                picked = x.gather(1, t[:, None]).squeeze(1).to(acc)
                top = top.to(acc)
                e = x.sub_(top[:, None]) if x.dtype == acc else torch.sub(x, top[:, None])   # float32
                total = e.exp_().sum(-1)                  # e = exp(x - top)
                loss += (total.log() + top - picked).sum()
                correct += (arg == t).sum()
                if need_h or need_w or need_b:
                    e.scatter_add_(1, t[:, None], -total[:, None])   # the target's entry becomes p_t - 1 below
                    inv = total.reciprocal()
                    g = e.mul_(inv[:, None]) if e is x else torch.mul(e, inv[:, None], out=x)   # softmax - one_hot
                    if need_h:
                        grad_h[r0:r0 + chunk_rows] = g @ w
                    if need_w:
                        if grad_w is None:
                            grad_w = torch.empty(weight.shape, dtype=accumulation_dtype(weight.dtype), device=dev)
                        for v0 in range(0, weight.shape[0], W_GRAD_ROWS):   # a (W_GRAD_ROWS, H) product at a time
                            part = g[:, v0:v0 + W_GRAD_ROWS].t() @ h
                            if r0 == 0:
                                grad_w[v0:v0 + W_GRAD_ROWS] = part
                            else:
                                grad_w[v0:v0 + W_GRAD_ROWS] += part
                    if need_b:
                        part = (e.t() @ inv if e is not x else g.sum(0)).to(accumulation_dtype(bias.dtype))
                        grad_b = part if grad_b is None else grad_b.add_(part)
                x = e = g = None   # this chunk's logits are freed before the next chunk's are made
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        grads = [None if g is None else (g * grad_loss.to(g.dtype)).to(dtype)
                 for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return (*grads, None, None, None, None)
