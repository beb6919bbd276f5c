"""A training step's floor: the time its operators need at a device's copy bandwidth and product peak.

Why: on one H100 the fastest pack configuration reached 30.5 % MFU with the GPU busy 82 % of the
step (docs/notebook.md, run 7), so most of the gap to 45 % is inside the kernels, not between
them. Whether the operators west dispatches can reach 45 % at all, and which ones stand in the way,
is arithmetic: every operator needs at least the longer of moving its bytes at the copy bandwidth
and doing its FLOPs at the product peak. Summed over a step, that floor bounds its time from below
and its MFU from above; the operators' shares rank what fusing would buy.

The step is the production forward and backward of one batch, counted on the meta device at the
real widths (no arithmetic runs, so the seed's 1.5B LLM takes seconds on a CPU), dispatching what
CUDA would (west.lab.cuda_standins). The optimizer's update is added by arithmetic. Not modelled:
the replayed encoder's padding rows (real rows only), autocast's float32 norms in the encoder (the
trainable modules are counted in bfloat16), caches (every operator reads its inputs from memory).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional

import torch

from west.batch import Batch
from west.lab.cuda_standins import STAND_INS, attention_flop_formulas, cuda_kernels
from west.lab.kernel_kinds import OTHER
from west.lab.traffic import Roofline
from west.models.llm import load_llm
from west.models.speech_llm import SpeechLLM

CATEGORIES = {
    "products": ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward"),
    "attention": ("attention", "attention_backward"),
    "norms": ("rms_norm", "rms_norm_backward", "native_layer_norm", "native_layer_norm_backward",
              "native_batch_norm", "native_batch_norm_backward"),
    "copies and casts": ("_to_copy", "copy_", "clone", "cat", "slice_backward", "select_backward",
                         "index", "index_select", "index_put_", "index_add_", "embedding",
                         "embedding_dense_backward", "new_zeros", "zeros", "zeros_like", "constant_pad_nd",
                         "gather", "scatter", "masked_scatter", "masked_fill_", "roll"),
}
OPTIMIZER = "optimizer"
OPTIMIZER_BYTES_PER_PARAM = 40   # AdamW: p, m, v read and written, g read (28); clipping: g read, then scaled (12)


def category(op: str) -> str:
    """The category of aten operator ``op`` (west.lab.kernel_kinds names a kernel's the same way)."""
    return next((name for name, ops in CATEGORIES.items() if op in ops), OTHER)


def meta_model(model_cfg, llm_dir: str | Path) -> torch.nn.Module:
    """SpeechLLM of ``model_cfg`` on the meta device, its LLM built from ``llm_dir``'s config.json
    (no weights read); the trainable modules in bfloat16, as autocast runs their products."""
    from transformers import AutoConfig  # heavy

    with torch.device("meta"):
        llm = load_llm(model_cfg.llm, AutoConfig.from_pretrained(str(llm_dir)))
    # the rest is small, and its set-up checks (the fused paths' tests against stock) compute
    model = SpeechLLM(model_cfg, llm=llm).to("meta").train()
    for name, module in model.named_children():
        if name != "llm":
            module.to(torch.bfloat16)
    return model


def segment_lengths(model: torch.nn.Module, batch: Batch) -> dict[bool, list[int]]:
    """The attention's segments in ``batch``: causal (the LLM's, its rows' tails included), and not
    (the encoder's frames per utterance after subsampling)."""
    host = batch.host
    llm = torch.diff(host.cu_seqlens.to(torch.int64)).tolist() if host.cu_seqlens is not None else \
        [host.input_ids.shape[1]] * host.input_ids.shape[0]
    enc = [model.shape.encoder_frames(n) for n in host.feat_lens.tolist()] if host.feat_lens is not None else []
    return {True: llm, False: enc}


FIGURES = ("calls", "bytes", "flops", "floor_s")


def _counted(model: torch.nn.Module, batch: Batch, bandwidth: float, peak: float, run) -> Roofline:
    """``run(moved)`` on ``batch`` moved to the meta device (its feats in bfloat16, as autocast's first
    product would cast them), counted under the CUDA stand-ins; the gradients cleared after."""
    mode = Roofline(bandwidth, peak, attention_flop_formulas(segment_lengths(model, batch)))
    moved = batch.to("meta")
    if moved.feats is not None:
        moved.feats = moved.feats.to(torch.bfloat16)
    with cuda_kernels(), mode:
        run(moved)
    model.zero_grad(set_to_none=True)
    return mode


def encoder_floor(model: torch.nn.Module, batch: Batch, bandwidth: float, peak: float) -> dict:
    """The speech encoder alone on ``batch``'s feats, as SpeechLLM runs it, forward and then backward
    from a gradient of ones: its share of the step's floor (bytes, FLOPs, operators, seconds)."""
    def run(moved: Batch) -> None:
        x, _ = model.encoder.forward_flat(moved.feats, **moved.encoder_inputs())
        x.backward(torch.ones_like(x))

    mode = _counted(model, batch, bandwidth, peak, run)
    return {"floor_s": mode.floor_s, "bytes": mode.bytes, "flops": mode.flops, "ops": mode.ops}


def step_floor(model: torch.nn.Module, batch: Batch, bandwidth: float, peak: float) -> dict:
    """Forward + backward of ``batch`` (a host batch; moved to the meta device here) through the meta
    ``model``, counted as CUDA dispatches it: per operator calls, bytes, FLOPs and floor seconds at
    ``bandwidth`` bytes/s and ``peak`` FLOP/s; the optimizer's update by arithmetic; and the
    encoder's share (:func:`encoder_floor`)."""
    mode = _counted(model, batch, bandwidth, peak, lambda moved: model(moved)["loss_sum"].float().backward())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ops = {name: {"calls": mode.calls[name], "bytes": mode.by_op[name], "flops": mode.flops_by_op[name],
                  "floor_s": mode.floor_by_op[name], "category": category(name)} for name in mode.calls}
    opt_bytes = OPTIMIZER_BYTES_PER_PARAM * trainable
    ops["optimizer (AdamW + clip, by arithmetic)"] = {"calls": 0, "bytes": opt_bytes, "flops": 0,
                                                       "floor_s": opt_bytes / bandwidth, "category": OPTIMIZER}
    counters = batch.host.counters
    encoder = encoder_floor(model, batch, bandwidth, peak) if batch.host.feats is not None else None
    return {"ops": ops, "encoder": encoder, "trainable_params": trainable, "bandwidth": bandwidth, "peak": peak,
            "llm_tokens": counters.get("computed_llm_tokens"), "utterances": counters.get("utterances"),
            "stand_ins": sorted(n for n in mode.calls if n in STAND_INS)}


def merged_ops(steps: list[dict]) -> dict[str, dict]:
    """Each operator's figures summed over ``steps``' results."""
    out: dict[str, dict] = {}
    for s in steps:
        for name, v in s["ops"].items():
            o = out.setdefault(name, {**dict.fromkeys(FIGURES, 0), "category": v["category"]})
            for key in FIGURES:
                o[key] += v[key]
    return out


def totals(steps: list[dict]) -> dict:
    """Per category and overall, summed over ``steps``' results: calls, bytes, FLOPs, floor."""
    cats: dict[str, Counter] = {}
    for v in merged_ops(steps).values():
        cats.setdefault(v["category"], Counter()).update({k: v[k] for k in FIGURES})
    whole = Counter()
    for c in cats.values():
        whole.update(c)
    return {"categories": {k: dict(v) for k, v in sorted(cats.items(), key=lambda kv: -kv[1]["floor_s"])},
            "whole": dict(whole)}


def table(steps: list[dict], top: int = 12, measured_step_s: Optional[float] = None) -> str:
    """Markdown: the floor per category and per costliest operator, per step, and the MFU ceiling."""
    n = len(steps)
    t = totals(steps)
    whole = t["whole"]
    bw, peak = steps[0]["bandwidth"], steps[0]["peak"]
    lines = [f"| per step (mean of {n}) | calls | GB moved | TFLOP | floor ms | share of the floor |",
             "|---|---|---|---|---|---|"]

    def row(name: str, v: dict) -> str:
        return (f"| {name} | {v['calls'] / n:,.0f} | {v['bytes'] / n / 1e9:.2f} | {v['flops'] / n / 1e12:.2f} | "
                f"{v['floor_s'] / n * 1e3:.1f} | {v['floor_s'] / whole['floor_s']:.0%} |")

    lines += [row(name, v) for name, v in t["categories"].items()]
    lines.append(row("**whole step**", whole))
    ops = sorted(merged_ops(steps).items(), key=lambda kv: -kv[1]["floor_s"])[:top]
    lines += ["", "| operator (costliest floors) | category | calls | GB moved | TFLOP | floor ms |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {v['category']} | {v['calls'] / n:,.0f} | "
              f"{v['bytes'] / n / 1e9:.2f} | {v['flops'] / n / 1e12:.2f} | {v['floor_s'] / n * 1e3:.1f} |"
              for name, v in ops]
    floor_ms = whole["floor_s"] / n * 1e3
    ceiling = whole["flops"] / peak / whole["floor_s"]
    lines += ["", f"floor {floor_ms:.1f} ms per step at {bw / 1e9:,.0f} GB/s and {peak / 1e12:,.1f} TFLOP/s: "
              f"the products and attention alone {whole['flops'] / n / peak * 1e3:.1f} ms; "
              f"MFU at most {ceiling:.0%} with these operators (recomputed FLOPs, if any, counted as work)"]
    encoders = [s["encoder"] for s in steps if s.get("encoder")]
    if encoders:
        enc = {k: sum(e[k] for e in encoders) / n for k in ("floor_s", "bytes", "flops")}
        lines.append(f"of it the speech encoder (its forward and backward counted again alone): {enc['floor_s'] * 1e3:.1f} ms, "
                     f"{enc['bytes'] / 1e9:.1f} GB, {enc['flops'] / 1e12:.2f} TFLOP")
    if measured_step_s:
        lines.append(f"measured step {measured_step_s * 1e3:.0f} ms: {floor_ms / (measured_step_s * 1e3):.0%} "
                     f"of it is the floor")
    return "\n".join(lines)


def floors_ms(steps: list[dict]) -> dict[str, float]:
    """Floor ms per step by category (the means over ``steps``)."""
    return {c: v["floor_s"] / len(steps) * 1e3 for c, v in totals(steps)["categories"].items()}
