"""Summed cross-entropy of a linear head over a large vocabulary, without the (N, V) logits.

SpeechLLM's loss is CE(h @ W.T (+ b), target) summed over the label rows, plus the count of
rows whose argmax is the target. With Qwen2's 151,936 tokens, 1,500 label rows give 0.9 GB of
float32 logits, their bf16 copy and their gradient. :func:`linear_cross_entropy` computes the
same two numbers tile by tile (``impl="chunked"``), so at most one tile of logits exists at a
time; on CUDA it can hand the work to Liger-Kernel or Apple's cut-cross-entropy instead.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from west.models.config import LOSS_IMPLS
from west.models.precision import accumulation_dtype, autocast_dtype, autocast_on

MIN_VOCAB_BLOCK = 1024   # narrowest logits tile (columns) the chunked path makes, for GEMM efficiency
CCE_IMPL = "cce"   # cut-cross-entropy's own default (gradient filtering below bf16 precision)

# impl -> (module, function, pip package)
_LIBRARIES = {
    "liger": ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy", "liger-kernel"),
    "cce": ("cut_cross_entropy", "linear_cross_entropy", "cut-cross-entropy"),
}


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
    * ``"chunked"``: the logits in tiles of at most ``chunk_rows`` x V elements (rows x a block
      of the vocabulary, merged online); backward recomputes each tile's logits from (h, W,
      the per-row logsumexp), so the extra memory is about one tile (its float32 and bf16
      copies) and, when W trains, W's float32 gradient. W's gradient matmul is skipped when W
      does not require grad. The default 512 x 151,936 is a 0.3 GB float32 tile; CPU time
      was flat from 256 to 1024 at that vocabulary and 128 was slower at small ones.
    * ``"plain"``: the reference, all N x V logits at once.
    * ``"liger"`` / ``"cce"``: Liger-Kernel's fused linear cross entropy / cut-cross-entropy's
      ``linear_cross_entropy`` (impl :data:`CCE_IMPL`), CUDA tensors only. They do not return
      the argmax, so ``n_correct`` costs one extra no-grad forward matmul, in chunks.
    * ``"auto"``: liger if importable and the tensors are on CUDA, else cce likewise, else chunked.

    N == 0 gives zeros whose graph still reaches ``hidden``, ``weight`` and ``bias`` (zero
    gradients), so DDP sees every parameter used on a batch without labels.
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {LOSS_IMPLS}")
    target = _checked_target(hidden, weight, target, bias, chunk_rows)
    if impl == "auto":
        impl = _auto_impl(hidden)
    fn = _library_or_error(impl, hidden) if impl in _LIBRARIES else None   # even for N == 0
    if hidden.shape[0] == 0:
        return _empty(hidden, weight, bias)
    if impl == "chunked":
        return _ChunkedLinearCE.apply(hidden, weight, bias, target, chunk_rows, _compute_dtype(hidden, weight))
    if impl == "plain":
        return _plain(hidden, weight, target, bias)
    return _library(impl, fn, hidden, weight, target, bias, chunk_rows)


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


def _tiles(n: int, v: int, chunk_rows: int) -> tuple[int, int]:
    """(rows, vocab columns) of one logits tile, at most ``chunk_rows * v`` elements.

    A tile is as tall as the budget allows while at least MIN_VOCAB_BLOCK columns wide: with
    a large vocabulary all label rows fit in one tile row, so each block of W's gradient is
    written once by one matmul over all rows (as the plain path computes it) instead of
    being accumulated over row chunks (a (V, H) read-modify-write per chunk)."""
    budget = chunk_rows * v
    rows = min(n, max(chunk_rows, budget // min(v, MIN_VOCAB_BLOCK)))
    return rows, min(v, budget // rows)


class _ChunkedLinearCE(torch.autograd.Function):
    """Forward keeps (h, W, b, target, per-row logsumexp), merging the tiles' maxima and
    exp-sums online; backward recomputes each tile's logits and turns them into
    (softmax - one_hot) * grad in place."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, chunk_rows: int, cd: torch.dtype):
        acc = accumulation_dtype(cd)
        (n, _), v = hidden.shape, weight.shape[0]
        rows, cols = _tiles(n, v, chunk_rows)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
        with _no_autocast(hidden):
            h_all = hidden.to(cd)
            for r0 in range(0, n, rows):
                h, t = h_all[r0:r0 + rows], target[r0:r0 + rows]
                top = torch.full(t.shape, -torch.inf, dtype=acc, device=t.device)   # running max
                arg = torch.zeros_like(t)                                          # its index
                total = torch.zeros_like(top)                                      # sum exp(x - top)
                picked = torch.zeros_like(top)                                     # target logit
                for v0 in range(0, v, cols):
                    x = F.linear(h, weight[v0:v0 + cols].to(cd), None if bias is None else bias[v0:v0 + cols].to(cd))
                    x = x.to(acc)
                    bmax, barg = x.max(-1)
                    inside = (t >= v0) & (t < v0 + x.shape[1])
                    at = x.gather(1, (t - v0).clamp_(0, x.shape[1] - 1)[:, None]).squeeze(1)
                    picked = torch.where(inside, at, picked)
                    better = bmax > top   # strict: ties keep the first index, as argmax does
                    arg = torch.where(better, barg + v0, arg)
                    new_top = torch.maximum(top, bmax)
                    total = total * (top - new_top).exp() + x.sub_(new_top[:, None]).exp_().sum(-1)
                    top = new_top
                lse[r0:r0 + rows] = total.log() + top
                loss += (lse[r0:r0 + rows] - picked).sum()
                correct += (arg == t).sum()
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.chunk_rows, ctx.cd = chunk_rows, cd
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cd, acc = ctx.cd, lse.dtype
        (n, _), v = hidden.shape, weight.shape[0]
        rows, cols = _tiles(n, v, ctx.chunk_rows)
        dev = hidden.device
        grad_h = torch.zeros(hidden.shape, dtype=accumulation_dtype(hidden.dtype), device=dev) if need_h else None
        grad_w = torch.empty(weight.shape, dtype=accumulation_dtype(weight.dtype), device=dev) if need_w else None
        grad_b = torch.empty(bias.shape, dtype=accumulation_dtype(bias.dtype), device=dev) if need_b else None
        go = grad_loss.to(acc)
        with _no_autocast(hidden):
            h_all = hidden.to(cd)
            for r0 in range(0, n, rows):
                h, t, lse_r = h_all[r0:r0 + rows], target[r0:r0 + rows], lse[r0:r0 + rows, None]
                for v0 in range(0, v, cols):
                    w = weight[v0:v0 + cols].to(cd)
                    p = F.linear(h, w, None if bias is None else bias[v0:v0 + cols].to(cd)).to(acc)
                    p.sub_(lse_r).exp_()                                    # softmax
                    inside = ((t >= v0) & (t < v0 + p.shape[1])).to(acc)    # - one_hot, without a sync:
                    p.scatter_add_(1, (t - v0).clamp_(0, p.shape[1] - 1)[:, None], -inside[:, None])
                    p.mul_(go)
                    g = p.to(cd)
                    if need_h:
                        grad_h[r0:r0 + rows] += g @ w
                    for grad, part in ((grad_w, (g.t() @ h) if need_w else None),
                                       (grad_b, p.sum(0) if need_b else None)):
                        if part is None:
                            continue
                        if r0 == 0:   # first (usually only) row tile: written once, not accumulated
                            grad[v0:v0 + cols] = part
                        else:
                            grad[v0:v0 + cols] += part
        return (None if grad_h is None else grad_h.to(hidden.dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


# ---------------------------------------------------------------- optional CUDA libraries
def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _library_fn(impl: str) -> Callable | None:
    """The library's loss function, or None when the package is not importable."""
    module, name, package = _LIBRARIES[impl]
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    fn = getattr(mod, name, None)
    if fn is None:
        raise RuntimeError(f"impl={impl!r}: the installed {package} has no {module}.{name}")
    return fn


def _auto_impl(hidden: torch.Tensor) -> str:
    if _on_cuda(hidden):
        for impl in ("liger", "cce"):
            if _library_fn(impl) is not None:
                return impl
    return "chunked"


def _library_or_error(impl: str, hidden: torch.Tensor) -> Callable:
    fn = _library_fn(impl)
    if fn is None:
        raise RuntimeError(f"impl={impl!r} needs the {_LIBRARIES[impl][2]} package, which is not importable "
                           "here; use impl='chunked' (or 'auto')")
    if not _on_cuda(hidden):
        raise ValueError(f"impl={impl!r} runs on CUDA tensors only; hidden is on {hidden.device} "
                         "(use impl='chunked' or 'auto')")
    return fn


def _library(impl: str, fn: Callable, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
             bias: torch.Tensor | None, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "liger":
        # Liger's forward runs under the caller's autocast and keeps float32 gradient
        # buffers for float32 weights, so the tensors go in as they are.
        loss = fn(hidden, weight, target, bias=bias, reduction="sum")
    else:
        # cut-cross-entropy before 25.6 ignores autocast: cast as F.linear would.
        cd = _compute_dtype(hidden, weight)
        extra = {} if bias is None else {"bias": bias.to(cd)}   # bias= exists from 25.1.2 on
        loss = fn(hidden.to(cd), weight.to(cd), target, reduction="sum", impl=CCE_IMPL, **extra)
    return loss.float(), _count_correct(hidden, weight, target, bias, chunk_rows)


@torch.no_grad()
def _count_correct(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                   bias: torch.Tensor | None, chunk_rows: int) -> torch.Tensor:
    """Rows whose argmax is the target, chunk by chunk (one extra forward matmul)."""
    cd = _compute_dtype(hidden, weight)
    correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
    with _no_autocast(hidden):
        w, b = weight.to(cd), (None if bias is None else bias.to(cd))
        for s in range(0, hidden.shape[0], chunk_rows):
            logits = F.linear(hidden[s:s + chunk_rows].to(cd), w, b)
            correct += (logits.argmax(-1) == target[s:s + chunk_rows]).sum()
    return correct
