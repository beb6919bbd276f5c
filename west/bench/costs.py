"""What a batch costs: real vs computed tokens, frames and attention terms, and counted FLOPs.

Attention terms Σ len² (real) are set against what the kernels run (padded B·Lmax²;
packed Σ over segments, incl. a row's dummy tail, bucketed as west's segment SDPA groups
them). FLOPs are counted by ``torch.utils.flop_counter`` on the exact batches, with
GQA-safe formulas for the fused SDPA kernels registered here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from west.batch import IGNORE_INDEX, Batch
from west.models.attention import SegmentPlan
from west.models.conformer import RelPositionAttention
from west.models.mlp_checkpoint import RECOMPUTED_SHARE, recomputes
from west.models.whisper_encoder import WhisperPackedEncoder
from west.shapes import SpeechShape
from west.train.step import autocast

# west.models.hf_attention.packed_kwargs groups packed LLM segments with 8 buckets per octave.
LLM_BUCKETS_PER_OCTAVE = 8


def _plan_cost(lengths: Sequence[int], buckets: Optional[int]) -> int:
    """Σ n² over the groups segment SDPA runs (each segment padded to its bucket length)."""
    plan = SegmentPlan.from_lengths(lengths, "cpu", buckets)
    return sum(int(g.index.shape[0]) * g.length ** 2 for g in plan.groups)


def batch_shapes(b: Batch, shape: SpeechShape, buckets: Optional[int] = 8,
                 padded_frames: Optional[int] = None, packs_padded: bool = False) -> dict:
    """What one batch holds (real) and what the model computes for it. ``shape`` gives the
    encoder's frame formula, ``buckets`` its packed attention grouping; ``padded_frames``:
    every utterance runs at this many encoder frames (padded to 30 s: 1500); ``packs_padded``:
    the encoder packs padded feats itself (``FlatEncoder.packs_padded_input``)."""
    rows, width = (int(x) for x in b.input_ids.shape)
    out = {"rows": rows, "width": width, **{k: int(v) for k, v in b.counters.items()}}
    if b.is_packed:
        cu = b.cu_seqlens.long().tolist()
        segs = [e - s for s, e in zip(cu, cu[1:])]
        labels = b.labels.reshape(-1)
        lens = [e - s for s, e in zip(cu, cu[1:]) if bool((labels[s:e] != IGNORE_INDEX).any())]
        out["llm_attn_computed"] = _plan_cost(segs, LLM_BUCKETS_PER_OCTAVE)
        out["llm_attn_dense_segments"] = sum(n * n for n in segs)
    else:
        lens = b.attention_mask.sum(1).tolist()
        out["llm_attn_computed"] = out["llm_attn_dense_segments"] = rows * width * width
    out["llm_attn_real"] = sum(int(n) ** 2 for n in lens)
    feat_lens = b.feat_lens.tolist() if b.feat_lens is not None else []
    sub = [shape.encoder_frames(int(t)) for t in feat_lens]
    out["enc_sub_frames_real"] = sum(sub)
    out["enc_attn_real"] = sum(n * n for n in sub)
    if padded_frames:
        out["enc_sub_frames_computed"] = len(sub) * padded_frames
        out["enc_attn_computed"] = len(sub) * padded_frames ** 2
    elif b.encoder_packed or not sub or packs_padded:
        out["enc_sub_frames_computed"] = sum(sub)
        out["enc_attn_computed"] = _plan_cost(sub, buckets)
    else:
        t = shape.encoder_frames(int(b.feats.shape[1]))
        out["enc_sub_frames_computed"] = len(sub) * t
        out["enc_attn_computed"] = len(sub) * t * t
    return out


def summarize(shapes: Sequence[dict]) -> dict:
    """Sum per-batch shapes into per-mode totals and ratios."""
    keys = [k for k in shapes[0] if k != "width"] if shapes else []
    tot = {k: sum(s[k] for s in shapes) for k in keys}
    tot["batches"] = len(shapes)
    ratio = lambda a, b: tot[a] / tot[b] if tot.get(b) else float("nan")  # noqa: E731
    tot["llm_useful"] = ratio("real_llm_tokens", "computed_llm_tokens")
    tot["enc_useful"] = ratio("real_enc_frames", "computed_enc_frames")
    tot["llm_attn_useful"] = ratio("llm_attn_real", "llm_attn_computed")
    tot["enc_attn_useful"] = ratio("enc_attn_real", "enc_attn_computed")
    if len(shapes) > 1:  # steady state: without the least-filled batch (an epoch's last, partial pack)
        worst = min(range(len(shapes)), key=lambda i: shapes[i]["real_llm_tokens"] / shapes[i]["computed_llm_tokens"])
        rest = [s for i, s in enumerate(shapes) if i != worst]
        tot["llm_useful_wo_least_filled"] = (sum(s["real_llm_tokens"] for s in rest)
                                             / sum(s["computed_llm_tokens"] for s in rest))
    return tot


def _sdpa_fwd_flops(q, k, v) -> int:
    """QKᵀ and PV of SDPA from shapes (B, Hq, L, D), (B, Hkv, S, D), (B, Hkv, S, Dv); GQA-safe
    (the kv heads are shared, the products still run per query head)."""
    b, h, lq, d = q[-4:] if len(q) == 4 else (1, *q[-3:])
    s, dv = k[-2], v[-1]
    return 2 * b * h * lq * s * d + 2 * b * h * lq * s * dv


def sdpa_flops() -> dict:
    """FLOP formulas for every fused SDPA kernel (CPU and CUDA) that hold with GQA shapes:
    torch's own are missing on CPU and assert on GQA in some releases (torch 2.11 on CUDA).
    Backward = 2.5 × forward (recomputed scores + dV, dP, dQ, dK), torch's convention."""
    aten = torch.ops.aten

    def fwd(q, k, v, *args, out_shape=None, **kwargs):
        return _sdpa_fwd_flops(q, k, v)

    def bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs):
        return 5 * _sdpa_fwd_flops(q, k, v) // 2

    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    table = {}
    for n in names:
        if hasattr(aten, n):
            table[getattr(aten, n)] = fwd
        if hasattr(aten, n + "_backward"):
            table[getattr(aten, n + "_backward")] = bwd
    return table


def count_flops(model: torch.nn.Module, batches: Sequence[Batch], device: torch.device,
                precision: str = "fp32") -> dict:
    """Forward+backward FLOPs over ``batches``: ``total``, ``forward``, ``backward`` (executed:
    activation checkpointing's replay included, counted whole; in training the replay stops after
    the last tensor the backward needs, a little less), ``replay`` (that replay: the forward FLOPs
    of the checkpointed blocks, so ``total - replay`` is the step's work without checkpointing)
    and the forward FLOPs of each top-level part (``fwd_<child>``; a child called through a method has
    what the root's forward does outside its called children, else the LLM has it: the loss
    over its output embedding). Weights are not updated; this pass doubles
    as the warm-up that sees every batch shape once, in the training ``precision`` (its kernels
    and its activation memory). (Per-module numbers come from forward
    hooks only: torch's attribution of backward ops to modules is approximate.) Packed LLM
    attention is counted as segment SDPA runs it (segments padded to their bucket), an upper
    bound of what a varlen kernel computes; so is the Conformer's (``pos_enc: wenet``) and a packed
    Whisper's."""

    model.train()
    llm_cfg = getattr(getattr(model, "cfg", None), "llm", None)
    backend = getattr(llm_cfg, "attn_backend", None)
    if backend is not None:   # count packed LLM attention as segment SDPA on every device: the
        llm_cfg.attn_backend = "sdpa_segments"  # flop counter cannot see into varlen kernels' custom ops
    varlen = [m for m in model.modules() if isinstance(m, (RelPositionAttention, WhisperPackedEncoder))
              and m.backend != "sdpa_segments"]
    saved = [m.backend for m in varlen]
    for m in varlen:   # the same for the Conformer's (pos_enc wenet under auto on CUDA) and a packed
        m.backend = "sdpa_segments"   # Whisper's or Qwen2-Audio tower's (auto: torch's varlen kernel)
    try:
        return _count(model, batches, device, precision)
    finally:
        if backend is not None:
            llm_cfg.attn_backend = backend
        for m, b in zip(varlen, saved):
            m.backend = b


def replayed_modules(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """{name: the share (numerator, denominator) of its forward FLOPs the backward runs again}:
    transformers' checkpointed decoder (and Whisper) layers and the Conformer's blocks when its
    ``gradient_checkpointing`` is on, whole; a frozen MLP under ``checkpoint_scope: mlp``, its
    gate and up products (``west.models.mlp_checkpoint.RECOMPUTED_SHARE``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # heavy

    encoder = getattr(model, "encoder", None)
    blocks = set(getattr(encoder, "blocks", ())) if getattr(encoder, "gradient_checkpointing", False) is True else set()
    out = {}
    for name, m in model.named_modules():
        if m in blocks or (isinstance(m, GradientCheckpointingLayer) and getattr(m, "gradient_checkpointing", False)):
            out[name] = (1, 1)
        elif recomputes(m):
            out[name] = RECOMPUTED_SHARE
    return out


class _TotalFlops(TorchDispatchMode):
    """Total FLOPs of the operators dispatched inside it, by torch's formulas plus :func:`sdpa_flops`,
    with no per-module attribution. For the backward: ``FlopCounterMode``'s module tracker keeps
    what each checkpointed layer's replay computes alive, so the count needed more memory than the
    step it counts (twice the plain step's live bytes on a checkpointed toy; on one H200 a random
    Qwen2-7B with LoRA at pack 16,384 ran out of its 140 GiB, where the step itself needs 40)."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import flop_registry, shape_wrapper  # heavy

        super().__init__()
        self.formulas = {**flop_registry, **{k: shape_wrapper(f) for k, f in sdpa_flops().items()}}
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


def _count(model: torch.nn.Module, batches: Sequence[Batch], device: torch.device, precision: str) -> dict:
    from torch.utils.checkpoint import set_checkpoint_early_stop  # heavy
    from torch.utils.flop_counter import FlopCounterMode  # heavy

    root = type(model).__name__
    children = [name for name, _ in model.named_children()]
    replayed = {f"{root}.{name}": share for name, share in replayed_modules(model).items()}
    out = {"total": 0, "forward": 0, "backward": 0, "replay": 0, **{f"fwd_{c}": 0 for c in children}}
    for b in batches:
        fwd = FlopCounterMode(display=False, custom_mapping=sdpa_flops())
        bwd = _TotalFlops()
        # checkpointed blocks replayed whole (no early stop, set when they run forward): ``replay``
        # is then exactly their forward FLOPs, which the forward counter attributes by module
        with fwd, autocast(device, precision), set_checkpoint_early_stop(False):
            loss = model(b.to(device))["loss_sum"]
        with bwd:
            loss.backward()
        model.zero_grad(set_to_none=True)
        counts = fwd.get_flop_counts()
        called = 0
        for c in children:
            n = _subtree_flops(counts, f"{root}.{c}")
            out[f"fwd_{c}"] += n
            called += n
        out["forward"] += int(fwd.get_total_flops())
        out["backward"] += bwd.total
        out["replay"] += sum(_subtree_flops(counts, name) * num // den   # inside "backward"
                             for name, (num, den) in replayed.items())
        # a child the root calls through a method (not __call__) has no hook: its FLOPs are the rest;
        # else the rest is the root's own work, SpeechLLM's loss over the LLM's output embedding
        rest = int(sum(counts.get(root, {}).values())) - called
        unhooked = [c for c in children if getattr(model, c) is not None
                    and not any(k == f"{root}.{c}" or k.startswith(f"{root}.{c}.") for k in counts)]
        owner = unhooked[0] if unhooked else ("llm" if "llm" in children else None)
        if owner is not None:
            out[f"fwd_{owner}"] += rest
    out["total"] = out["forward"] + out["backward"]
    return out


def _subtree_flops(counts: dict, name: str) -> int:
    """FLOPs of module ``name``: its own entry when it was called, else the sum over its
    outermost called descendants (a parent's entry already holds its children's)."""
    if name in counts:
        return int(sum(counts[name].values()))
    inside = sorted((k for k in counts if k.startswith(name + ".")), key=lambda k: k.count("."))
    top: list[str] = []
    for k in inside:
        if not any(k.startswith(t + ".") for t in top):
            top.append(k)
    return int(sum(sum(counts[k].values()) for k in top))


MIN_SPREAD = 0.2   # step_time_fit: the smallest batch at most 80 % of the largest


def step_time_fit(step_s: Sequence[float], tokens: Sequence[int]) -> Optional[dict]:
    """Least-squares ``time = fixed_s + per_token_s × tokens`` over one mode's timed steps (tokens:
    each batch's computed LLM positions). ``fixed_s`` is what a step costs whatever its size (on a
    GPU mostly the host's launches and the step's one synchronisation): it is why a sample with a
    partial last batch, over-weighted in a short pass, understates the mode with the biggest
    batches. None with fewer than 3 steps, or sizes within ``MIN_SPREAD`` of each other (all full
    batches of one budget: the slope would be noise)."""
    if len(step_s) != len(tokens):
        raise ValueError(f"{len(step_s)} step times for {len(tokens)} batches")
    if len(step_s) < 3 or max(tokens) - min(tokens) < MIN_SPREAD * max(tokens):
        return None
    n = len(step_s)
    mx, my = sum(tokens) / n, sum(step_s) / n
    sxx = sum((x - mx) ** 2 for x in tokens)
    slope = sum((x - mx) * (y - my) for x, y in zip(tokens, step_s)) / sxx
    return {"fixed_s": my - slope * mx, "per_token_s": slope, "steps": n}
