"""Varlen attention kernels that take ``cu_seqlens`` directly, and the choice among them.

Layout: q (rows, Hq, D), k/v (rows, Hkv, D), int32 ``cu_seqlens``; every segment attends
only to itself. Kernels:

* ``flash``: flash-attn's ``flash_attn_varlen_func`` (optional package, CUDA). Elsewhere a
  pure-torch reference with the same signature runs (west.models.flash_reference: one custom
  operator forward and backward, as the kernel dispatches), so CPU tests exercise the call.
* ``torch_varlen``: torch's own ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16),
  for GPU machines without flash-attn. Its keyword set changed across torch releases
  (``is_causal`` vs ``window_size``, ``scale``, ``enable_gqa``); :func:`torch_varlen` adapts.
* ``flex``: FlexAttention with a document mask (compiled on CUDA; forward-only on CPU).

:func:`choose_backend` resolves ``auto`` per (device, dtype) and logs the choice once.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, wraps
from typing import Callable, Optional

import torch

from west.models.flash_reference import check_cu as _check_cu
from west.models.flash_reference import flash_attn_varlen_reference
from west.models.flex import DocumentMask, flex_attention

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- flash-attn
@lru_cache(maxsize=1)
def _flash_kernel():
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore
    except Exception:  # ImportError, or a CUDA/ABI mismatch raised at import
        return None
    return flash_attn_varlen_func


def flash_available(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and _flash_kernel() is not None


@wraps(flash_attn_varlen_reference, assigned=())   # flash-attn's exact signature, stated once
def flash_varlen(*args, **kwargs) -> torch.Tensor:
    """``flash_attn_varlen_func`` on CUDA when importable, else the reference (same signature)."""
    q = args[0] if args else kwargs["q"]
    fn = (_flash_kernel() if q.is_cuda else None) or flash_attn_varlen_reference
    return fn(*args, **kwargs)


# --------------------------------------------------------------------------- flex
def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            causal: bool = False, scale: Optional[float] = None, mask=None) -> torch.Tensor:
    """FlexAttention with a document mask (tokens see only their own segment): west.models.flex.

    ``mask`` is the batch's prebuilt :class:`west.models.flex.DocumentMask` (what SpeechLLM
    passes, built from host lengths); without it one is built from ``cu_seqlens``, which reads
    them back to the host. Compiled on CUDA; forward-only on the CPU."""
    _check_cu(cu_seqlens, q.shape[0], "cu_seqlens")
    if mask is None:
        mask = DocumentMask(torch.diff(cu_seqlens.detach().to("cpu", torch.int64)).tolist(), q.device, causal)
    if mask.causal != causal:
        raise ValueError(f"document mask is {'causal' if mask.causal else 'bidirectional'}, the call is not")
    return flex_attention(q, k, v, mask, scale=scale)


# --------------------------------------------------------------------------- torch varlen
@lru_cache(maxsize=1)
def _torch_varlen_kernel() -> Optional[Callable]:
    try:
        from torch.nn.attention.varlen import varlen_attn  # heavy
    except Exception:  # torch < 2.9
        return None
    return varlen_attn


def torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 causal: bool = False, scale: Optional[float] = None,
                 kernel: Optional[Callable] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                 max_seqlen_k: Optional[int] = None) -> torch.Tensor:
    """Attention per segment through ``torch.nn.attention.varlen.varlen_attn``: self-attention, or
    with ``cu_seqlens_k`` keys of their own per segment (a shared prefix, west.models.shared_prefix;
    causal then aligned bottom-right, what the kernel's ``window_size`` gives).

    Keywords the installed kernel lacks are emulated exactly: a causal flag as
    ``window_size=(-1, 0)`` (torch >= 2.10) or ``is_causal``; a non-default scale by
    rescaling q; GQA by ``enable_gqa`` (torch >= 2.12), by the kernel itself where it groups
    the heads without that keyword (:func:`gqa_passes_through`), else by repeating k/v heads.
    ``kernel`` replaces the real one in CPU tests."""
    fn = kernel or _torch_varlen_kernel()
    if fn is None:
        raise RuntimeError("torch.nn.attention.varlen is not in this torch build (torch >= 2.9 needed)")
    _check_cu(cu_seqlens, q.shape[0], "cu_seqlens")
    keyed = cu_seqlens_k is not None
    if keyed:
        _check_cu(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    params = _parameters(fn)
    kw: dict = {}
    if causal:
        if "window_size" in params:
            kw["window_size"] = (-1, 0)
        elif "is_causal" in params and not keyed:
            kw["is_causal"] = True
        elif keyed:
            raise RuntimeError("this torch's varlen_attn has no window_size: a shared prefix needs torch >= 2.10 "
                               "(or flash-attn) on CUDA")
        else:
            raise RuntimeError("this torch's varlen_attn has no causal option")
    if scale is not None:
        if "scale" in params:
            kw["scale"] = scale
        else:
            q = q * (scale * q.shape[-1] ** 0.5)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif not gqa_passes_through(fn, q, kw):
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if not keyed:
        cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    return fn(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, **kw)


_PARAMETERS: dict = {}   # kernel -> its parameter names


def _parameters(fn: Callable):
    """The kernel's parameter names, read once per kernel: ``inspect.signature`` costs about 15 us
    of host time, and :func:`torch_varlen` runs once per attention layer and step. A compiled trace
    reads the signature itself and leaves the table alone."""
    if torch.compiler.is_compiling():
        return inspect.signature(fn).parameters
    names = _PARAMETERS.get(fn)
    if names is None:
        names = _PARAMETERS[fn] = frozenset(inspect.signature(fn).parameters)
    return names


_GQA_NATIVE: dict = {}   # (kernel, device, dtype) -> whether it takes fewer key/value heads as they are


def gqa_passes_through(fn: Callable, q: torch.Tensor, kw: dict) -> bool:
    """Whether ``fn``, a varlen kernel without an ``enable_gqa`` keyword, takes fewer key/value
    heads than query heads as they are (torch 2.10-2.11 hand them to flash attention, which
    groups the query heads itself) and gives what it gives for the heads repeated, forward and
    backward. Probed once per kernel, device and dtype on a small random input (a generator of
    its own: the run's random streams are untouched) and logged; repeating them instead costs two
    copies of every layer's keys and values and a sum of their gradients. A compiled trace always
    repeats them, and a CUDA graph capture does until the probe has run eagerly (exact either way)."""
    if torch.compiler.is_compiling():   # first, so that a trace reads nothing else here
        return False
    key = (fn, q.device.type, q.device.index, q.dtype)
    if key in _GQA_NATIVE:
        return _GQA_NATIVE[key]
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    with ThreadPoolExecutor(1) as thread:   # see _probe_gqa
        _GQA_NATIVE[key] = ok = thread.submit(_probe_gqa, fn, q.device, q.dtype, kw).result()
    log.info("torch varlen kernel on %s/%s: grouped key/value heads %s", q.device.type,
             str(q.dtype).replace("torch.", ""), "taken as they are" if ok else "repeated (the kernel does not group them)")
    return ok


def _probe_gqa(fn: Callable, device: torch.device, dtype: torch.dtype, kw: dict) -> bool:
    """Run in a thread of its own: the first attention call may sit inside an activation
    checkpoint, whose saved-tensor hooks (per thread) would count the probe's tensors in the forward
    and not in the replay (torch's CheckpointError); autocast, also per thread, stays out of it too."""
    lens, hq, hkv, d = [7, 20, 1], 4, 2, 64
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 7, 27, 28], dtype=torch.int32, device=device)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device, torch.inference_mode(False), torch.enable_grad():
        q, k, v = (torch.randn(sum(lens), h, d, generator=gen).to(device, dtype).requires_grad_()
                   for h in (hq, hkv, hkv))
        grad_out = torch.randn(sum(lens), hq, d, generator=gen).to(device, dtype)
        try:
            grouped = fn(q, k, v, cu, cu, max(lens), max(lens), **kw)
            repeated = fn(q, k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1),
                          cu, cu, max(lens), max(lens), **kw)
            got = (grouped, *torch.autograd.grad(grouped, (q, k, v), grad_out))
            want = (repeated, *torch.autograd.grad(repeated, (q, k, v), grad_out))
        except Exception:   # the kernel refused fewer key/value heads
            return False
    tol = 2e-2 if dtype in HALF else 1e-5
    return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol) for a, b in zip(got, want))


# --------------------------------------------------------------------------- choice
HALF = (torch.float16, torch.bfloat16)
_logged: set = set()


def choose_backend(device: torch.device, dtype: torch.dtype, dropout: bool = False,
                   flash: Optional[bool] = None, torch_varlen_ok: Optional[bool] = None) -> str:
    """What ``auto`` runs: on CUDA with fp16/bf16, flash-attn when installed, else torch's
    varlen kernel (no dropout) when this torch has it; everywhere else per-segment SDPA.
    Logged once per distinct answer. ``flash`` / ``torch_varlen_ok`` override detection (tests)."""
    device = torch.device(device)
    cuda_half = device.type == "cuda" and dtype in HALF
    flash = _flash_kernel() is not None if flash is None else flash
    if torch_varlen_ok is None:
        torch_varlen_ok = _torch_varlen_kernel() is not None and cuda_half and _sm80(device)
    if cuda_half and flash:
        name, why = "flash", "flash-attn is installed"
    elif cuda_half and torch_varlen_ok and not dropout:
        name, why = "torch_varlen", "flash-attn is not installed; torch.nn.attention.varlen"
    else:
        name = "sdpa_segments"
        why = ("CUDA needs fp16/bf16 for a varlen kernel" if device.type == "cuda" and not cuda_half
               else "attention dropout" if device.type == "cuda" and dropout
               else "no varlen kernel on this device" if device.type == "cuda" else f"{device.type}")
    key = (device.type, str(dtype), name)
    if key not in _logged:
        _logged.add(key)
        log.info("packed attention on %s/%s: %s (%s)", device.type, str(dtype).replace("torch.", ""), name, why)
    return name


def _sm80(device: torch.device) -> bool:
    """torch's varlen kernel is FlashAttention-2 inside: Ampere (sm80) or newer."""
    try:
        return torch.cuda.get_device_capability(device) >= (8, 0)
    except Exception:
        return False
