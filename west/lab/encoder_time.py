"""The Conformer's blocks alone at ``train.encoder_graphs``' static shape, eager and replayed: where
their GPU time goes.

Why: replayed in west-train, the blocks' forward spanned 23.5 ms of the GPU and their backward 28 ms
per pack (H200, docs/notebook.md, run 6) for about 1 ms of matrix products each way, and compiling them made the
benchmark's step longer (H100, docs/notebook.md, run 7). Whether that time is kernels (and which) or gaps between
them decides what comes next: other or fused kernels, or a look at the replay. Three figures per
variant: the host's and the drained time of a forward and of a forward + backward
(:func:`west.bench.timing.host_and_device_ms`), the kernels a profiler sees in one forward + backward
(count, summed time, the costliest by name), and once for the blocks, the bytes their eager
operators read and write (:class:`Traffic`, each operator's tensors in and out: an upper bound on
what fused kernels need) and the FLOPs of their products. ``tools/encoder_gpu_time.py`` runs it.
"""
from __future__ import annotations

import copy
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from west.bench.timing import host_and_device_ms
from west.lab.trace_gaps import GPU_CATS, load_events
from west.lab.traffic import Traffic, varlen_attention_flops
from west.models.layout import depthwise_conv1d, same_conv1d
from west.models.static_encoder import BlockStack, StaticBlocks


def traffic(step: Callable[[], object], top: int = 8) -> dict:
    """Operators (views apart) and the bytes they read and write over one ``step()``, with the
    ``top`` operators by bytes: what fusing would save first."""
    with Traffic() as mode:
        step()
    return {"ops": mode.ops, "bytes": mode.bytes,
            "top_ops": [{"op": name, "calls": mode.calls[name], "bytes": b} for name, b in mode.by_op.most_common(top)]}


def eager_blocks(static: StaticBlocks, args: tuple) -> torch.Tensor:
    """The blocks' own forward on ``args``, eager even after a capture: ``make_graphed_callables``
    replaces a module's ``forward`` with the replay, so ``static.stack(*args)`` replays once
    captured (in run 8, docs/notebook.md, the tool's "eager" rows were replays for that reason)."""
    return BlockStack.forward(static.stack, *args)


def attention_flops(cu_seqlens: Sequence[int], d_model: int) -> int:
    """Forward + backward FLOPs of attention within segments (non-causal; heads x head_dim = ``d_model``)."""
    return sum(varlen_attention_flops([b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])], 1, d_model, False))


def kernel_summary(events: Sequence[dict], iters: int, top: int = 8) -> dict:
    """GPU work in a Chrome trace of ``iters`` calls, per call: kernels (copies and memsets
    included), their summed time, and the ``top`` names by time with calls and ms per call."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in GPU_CATS:
            by_name[e["name"]][0] += 1
            by_name[e["name"]][1] += e["dur"] / 1e3
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": sum(n for n, _ in by_name.values()) / iters,
            "kernel_ms": sum(ms for _, ms in by_name.values()) / iters,
            "top": [{"name": name, "calls": n / iters, "ms": ms / iters} for name, (n, ms) in ranked]}


def profile_kernels(step: Callable[[], object], iters: int = 3) -> list[dict]:
    """The Chrome-trace events of ``iters`` calls of ``step()`` under torch.profiler, GPU activity
    only (the CPU's operators are not recorded, so the host is not slowed)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return load_events(path)


def time_variant(forward: Callable[[], torch.Tensor], grad: torch.Tensor, clear: Callable[[], None],
                 device: torch.device, repeats: int) -> dict:
    """Host and drained ms of the forward alone and of forward + backward (medians); on CUDA the
    kernels of one forward + backward, as :func:`kernel_summary` gives them."""
    def step() -> None:
        clear()
        forward().backward(grad)

    def fwd() -> None:
        clear()
        forward()

    fwd_host, fwd_ms = host_and_device_ms(fwd, device, repeats)
    step_host, step_ms = host_and_device_ms(step, device, repeats)
    out = {"forward_host_ms": fwd_host, "forward_ms": fwd_ms, "step_host_ms": step_host, "step_ms": step_ms,
           "backward_ms": step_ms - fwd_ms}
    if device.type == "cuda":
        out.update(kernel_summary(profile_kernels(step), iters=3))
    return out


def depthwise_times(conv: nn.Conv1d, length: int, dtype: torch.dtype, repeats: int) -> dict[str, dict]:
    """The blocks' depthwise convolution alone over one (1, C, ``length``) buffer, the replay's (its
    rows and the zero gaps between utterances), in ``dtype``: forward and forward + backward drained
    ms (input and weight gradients) through the convolution kernel (eager's path) and as k shifted
    products (compiled blocks' path; eager here), and how far apart their outputs are. Depthwise
    convolutions are a known slow path of some GPU stacks: if the kernel's row is a large part of
    the blocks' time and the products' row is faster, the eager blocks can take the products."""
    device = conv.weight.device
    module = copy.deepcopy(conv).to(dtype)
    x = torch.randn(1, conv.in_channels, length, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    forms = {"convolution kernel": lambda: same_conv1d(x, module), "shifted products": lambda: depthwise_conv1d(x, module)}

    def clear() -> None:
        for t in (x, *module.parameters()):
            t.grad = None

    out = {}
    for name, form in forms.items():
        _, fwd_ms = host_and_device_ms(lambda: (clear(), form()), device, repeats)
        _, step_ms = host_and_device_ms(lambda: (clear(), form().backward(grad)), device, repeats)
        out[name] = {"forward_ms": fwd_ms, "step_ms": step_ms}
    with torch.no_grad():
        ref = forms["convolution kernel"]().float()
        out["shifted products"]["max_abs_diff"] = float((forms["shifted products"]().float() - ref).abs().max())
    return out


def depthwise_table(times: dict[str, dict], channels: int, length: int, dtype: torch.dtype) -> str:
    lines = [f"| depthwise convolution over (1, {channels}, {length:,}), {str(dtype).replace('torch.', '')} | "
             "forward ms | forward + backward ms |", "|---|---|---|"]
    lines += [f"| {name} | {v['forward_ms']:.2f} | {v['step_ms']:.2f} |" for name, v in times.items()]
    diff = times["shifted products"]["max_abs_diff"]
    return "\n".join(lines + ["", f"largest difference between the two outputs: {diff:.2g}"])


def copy_bandwidth(device: torch.device, mib: int = 512, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy (bytes read plus bytes written), median of ``repeats``."""
    src = torch.randn(mib * 2**18, device=device)
    dst = torch.empty_like(src)
    _, ms = host_and_device_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def table(variants: dict[str, dict], floors: dict) -> str:
    """Markdown: one row per variant, its costliest kernels, and the floors' line."""
    lines = ["| blocks | forward ms (host) | backward ms | forward + backward ms (host) | kernels | kernel ms | "
             "idle in the span ms |", "|---|---|---|---|---|---|---|"]
    for name, v in variants.items():
        kernels = f"{v['kernels']:,.0f} | {v['kernel_ms']:.1f} | {v['step_ms'] - v['kernel_ms']:.1f}" \
            if "kernels" in v else "– | – | –"
        lines.append(f"| {name} | {v['forward_ms']:.1f} ({v['forward_host_ms']:.1f}) | {v['backward_ms']:.1f} | "
                     f"{v['step_ms']:.1f} ({v['step_host_ms']:.1f}) | {kernels} |")
    for name, v in variants.items():
        if v.get("top"):
            lines += ["", f"{name}, costliest kernels per forward + backward:", "",
                      "| kernel | calls | ms |", "|---|---|---|"]
            lines += [f"| {k['name'][:90]} | {k['calls']:.0f} | {k['ms']:.2f} |" for k in v["top"]]
    bw, peak = floors.get("copy_gb_s"), floors.get("matmul_tflop_s")
    at_bw = f" = {floors['bytes'] / bw / 1e6:.1f} ms at the copy's {bw:,.0f} GB/s" if bw else ""
    at_peak = f" = {floors['flops'] / peak / 1e9:.1f} ms at {peak:,.0f} TFLOP/s" if peak else ""
    lines += ["", f"eager forward + backward: {floors['ops']:,} operators moving {floors['bytes'] / 1e9:.2f} GB"
              f"{at_bw}; {floors['flops'] / 1e12:.2f} TFLOP of products and attention{at_peak}"]
    if floors.get("top_ops"):
        lines += ["", "| operator (most bytes) | calls | GB | share |", "|---|---|---|---|"]
        lines += [f"| {o['op']} | {o['calls']:,} | {o['bytes'] / 1e9:.2f} | {100 * o['bytes'] / floors['bytes']:.0f} % |"
                  for o in floors["top_ops"]]
    return "\n".join(lines)
