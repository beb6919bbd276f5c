"""``train.encoder_graphs``: the Conformer's blocks, forward and backward, captured once as CUDA
graphs and replayed every step, so that for the encoder the host launches two graphs instead of
thousands of small kernels (west.models.static_encoder pads every pack's encoder rows to one shape).

Unlike the LLM decoder of ``train.cuda_graphs`` these blocks train: the graph reads the weights
where the optimizer updates them in place, and its backward hands the weight gradients to autograd.
Those gradients live in the graph's own memory, which the next replay overwrites, so the run takes
one micro-batch per step (``train.accum_steps 1``) on one process; the config refuses the rest.
With ``train.compile`` the blocks were compiled in place before this runs,
so the capture's warm-up compiles them once at the static shape and the graph records inductor's
fused kernels: fewer and shorter kernels on the GPU, still two launches on the host. On a CPU there
is nothing to capture: the padded blocks run eagerly (or compiled), which the tests compare against
the unpadded (or uncompiled) encoder.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from west.models.conformer import encoder_backend
from west.models.static_encoder import KERNEL_ROUTES, StaticBlocks, StaticShape
from west.ranks import unwrap
from west.schema import ConfigError, require
from west.shapes import PackExtent
from west.train.config import TrainConfig

if TYPE_CHECKING:
    from west.config import Config

ROWS_STEP = 512       # planned rows are rounded up to a multiple of this: room for a later epoch's packs
SEGMENTS_STEP = 32    # planned segment slots likewise
LENGTH_STEP = 128     # the longest planned utterance likewise: the attention kernels' tile of rows
NO_PLAN_SEGMENTS, NO_PLAN_MAX_LEN = 256, 1024   # without a plan (41 s utterances at 40 ms a frame)


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def encoder_rows(rows: int, pack_tokens: int, projector_stride: int, planned: int = 0) -> tuple[int, str]:
    """The static shape's rows, and where they come from. ``rows`` when set; else the most encoder
    frames of any planned pack (``planned``) rounded up to :data:`ROWS_STEP`; without a plan,
    ``pack_tokens`` × the projector's stride, which every pack fits (each speech token stands for
    ``stride`` frames and takes one LLM position), at most that in any case. Every padding row
    costs the replay what a real one does: the built-in corpus fills a pack of 8,192 with about
    9,650 frames, so the bound (16,384) would compute 70 % more rows than it holds. A later
    epoch's pack above the rows runs eagerly and is counted in the run's last line."""
    bound = pack_tokens * projector_stride
    if rows:
        return rows, "train.encoder_graph_rows"
    if planned:
        return (min(bound, round_up(planned, ROWS_STEP)),
                f"the largest planned pack holds {planned:,} encoder frames, rounded up to a multiple of {ROWS_STEP}")
    return bound, f"no plan: pack_tokens {pack_tokens:,} x projector stride {projector_stride}, which any pack fits"


def encoder_max_len(max_len: int, longest: int = 0) -> tuple[int, str]:
    """The longest segment the attention kernel is sized for, and where it comes from: ``max_len``
    when set, else the plan's longest utterance rounded up to :data:`LENGTH_STEP`, else
    :data:`NO_PLAN_MAX_LEN`. The padding rows' segments are at most this long too."""
    if max_len:
        return max_len, "train.encoder_graph_max_len"
    if longest:
        return (round_up(longest, LENGTH_STEP),
                f"the longest planned utterance has {longest:,} encoder frames, rounded up to {LENGTH_STEP}")
    return NO_PLAN_MAX_LEN, f"no plan: {NO_PLAN_MAX_LEN:,} frames"


def encoder_segments(segments: int, rows: int, max_len: int, planned: int = 0) -> tuple[int, str]:
    """Segment slots per pack, and where they come from: ``segments`` when set, else the most
    utterances of any planned pack plus the padding's segments (at most ``rows`` / ``max_len``,
    rounded up), rounded up to :data:`SEGMENTS_STEP`; without a plan :data:`NO_PLAN_SEGMENTS`.
    Why not always the most: the attention kernels launch work for every slot × ``max_len``, so
    empty slots and a longer bound than any utterance cost the GPU on every replayed layer."""
    padding = -(-rows // max_len)
    if segments:
        if segments < 1 + padding:
            raise ConfigError(f"train.encoder_graph_segments: must be >= {1 + padding}: one utterance and "
                              f"{rows:,} rows of padding in segments of at most {max_len:,} frames")
        return segments, "train.encoder_graph_segments"
    if planned:
        return (round_up(planned + padding, SEGMENTS_STEP),
                f"the fullest planned pack holds {planned:,} utterances, and the padding up to {padding} "
                f"segments, rounded up to a multiple of {SEGMENTS_STEP}")
    return max(NO_PLAN_SEGMENTS, 1 + padding), f"no plan: {NO_PLAN_SEGMENTS} slots"


def encoder_shape(train: TrainConfig, pack_tokens: int, projector_stride: int,
                  extent: PackExtent = PackExtent()) -> tuple[StaticShape, str]:
    """(the static shape, where its sizes come from): rows, the longest utterance and segment slots
    from the config's ``train.encoder_graph_*`` where set, else from the plan's ``extent``. What
    west-train and the benchmark replay at."""
    rows, rows_why = encoder_rows(train.encoder_graph_rows, pack_tokens, projector_stride, extent.encoder_frames)
    max_len, len_why = encoder_max_len(train.encoder_graph_max_len, extent.longest)
    segments, seg_why = encoder_segments(train.encoder_graph_segments, rows, max_len, extent.segments)
    return StaticShape(rows, segments, max_len), f"rows: {rows_why}; segments: {seg_why}; longest: {len_why}"


def describe_shape(shape: StaticShape, why: str) -> str:
    """The line west-train prints at its start (and tools/gpu_suite.sh reads back)."""
    return (f"train.encoder_graphs: the encoder's blocks replay at {shape.tokens:,} rows per pack in "
            f"{shape.segments} segments of at most {shape.max_seqlen:,} frames ({why})")


def static_encoder_for(model: nn.Module, shape: StaticShape, precision: str, device: torch.device,
                       world_size: int = 1, warmup_iters: int = 3) -> StaticBlocks:
    """Route ``model``'s packed training batches through its encoder's blocks at ``shape``; on
    CUDA, capture those blocks' forward and backward (``model`` already on ``device``)."""
    speech_llm = unwrap(model)
    encoder = speech_llm.encoder
    attn = encoder.blocks[0].attn   # the route its packed training rows take (dropout on)
    blocker = where_blocker(attn.backend, attn.attn_dropout, attn.key_positions, precision, device, world_size)
    if blocker:
        raise ConfigError(f"train.encoder_graphs: {blocker}")
    route = encoder_backend(attn.backend, device, True, attn.attn_dropout, attn.key_positions,
                            _activation_dtype(precision))
    static = StaticBlocks(encoder, shape, route)
    encoder.static_blocks = static
    if device.type == "cuda":
        was_training = encoder.training
        encoder.train()   # recorded as it trains (dropout inside the graph)
        capture(static, precision, warmup_iters)
        encoder.train(was_training)
    return static


def where_blocker(backend: str, attn_dropout: float, key_positions: bool, precision: str, device: torch.device,
                  world_size: int) -> str | None:
    """Why the replay cannot run on ``device`` with ``world_size`` processes (None: it can): its
    weight gradients bypass DDP's hooks, and only a cu_seqlens kernel takes the static segments."""
    if world_size > 1:
        return ("one process only (the graph's weight gradients are not reduced across ranks by DDP's "
                f"hooks), the run has {world_size}")
    route = encoder_backend(backend, device, True, attn_dropout, key_positions, _activation_dtype(precision))
    if route not in KERNEL_ROUTES:
        return (f"the encoder's packed rows run {route} on {device.type} (a cu_seqlens kernel needs CUDA with "
                "bf16, or model.encoder.attn_backend varlen without attention dropout)")
    return None


def _activation_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def capture(static: StaticBlocks, precision: str, warmup_iters: int = 3) -> None:
    """``static.replay`` := the blocks' forward + backward as CUDA graphs (make_graphed_callables
    on the block stack, a module: its trainable weights are the graph's inputs), recorded on rows of
    padding at the static shape, bf16 autocast inside with its weight-cast cache off."""
    device = next(static.stack.parameters()).device
    static.stack.autocast = torch.bfloat16 if precision == "bf16" else None
    sample = static.sample_inputs(_activation_dtype(precision), device)
    static.replay = graphed(static.stack, sample, warmup_iters, "train.encoder_graphs",
                            f"the encoder's blocks at {static.shape}")


def graphed(fn, sample: tuple, warmup_iters: int, key: str, what: str):
    """``torch.cuda.make_graphed_callables(fn, sample)``; a failure names the config key that asked
    for it and what was being captured, not only where inside torch it failed."""
    try:
        return torch.cuda.make_graphed_callables(fn, sample, num_warmup_iters=warmup_iters)
    except Exception as e:
        alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        hint = (f" or with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False (now {alloc!r}: some torch builds "
                "capture badly with expandable segments)" if "expandable_segments:True" in alloc else "")
        raise RuntimeError(f"{key}: capturing {what} failed ({type(e).__name__}: {e}); train without it "
                           f"({key} false){hint}") from e


def check_encoder_graphs(cfg: Config) -> None:
    """train.encoder_graphs replays one captured block stack that trains: packed Conformer rows on
    the cu_seqlens kernel route, its gradients used before the next replay (one micro-batch, one
    process), and nothing else rewriting the blocks (bf16 copies, checkpointing). Compiled blocks
    (``train.compile``) are what the graph records: inductor's fused kernels
    at the one static shape, compiled once. ``auto`` is decided where the run starts
    (:func:`resolve_encoder_graphs`)."""
    train = cfg.train
    if train.encoder_graphs == "false":
        return
    if train.encoder_graph_rows and train.encoder_graph_segments and train.encoder_graph_max_len:
        encoder_segments(  # else checked once the plan sizes it
            train.encoder_graph_segments, train.encoder_graph_rows, train.encoder_graph_max_len)
    if train.encoder_graphs == "true":
        blockers = encoder_graph_blockers(cfg)
        require(not blockers, "train.encoder_graphs", blockers[0] if blockers else "")


def encoder_graph_blockers(cfg: Config, device: Optional[torch.device] = None, world_size: int = 1) -> list[str]:
    """Why train.encoder_graphs cannot run with ``cfg`` (empty: it can); with ``device``, also why
    it cannot run there with ``world_size`` processes (west.train.encoder_graphs.where_blocker)."""
    from west.data.policies import POLICIES  # heavy (the data side says which modes pack rows)

    train, enc = cfg.train, cfg.model.encoder
    checks = [
        (POLICIES[cfg.data.batch_type].packs_rows, f"needs data.batch_type pack, got {cfg.data.batch_type}"),
        (enc.type == "conformer" and enc.pos_enc == "wenet" and enc.attn_backend in ("auto", "varlen"),
         "needs west's Conformer with model.encoder.pos_enc wenet and attn_backend auto or varlen (packed rows "
         f"through a cu_seqlens kernel), got type {enc.type}, pos_enc {enc.pos_enc}, attn_backend {enc.attn_backend}"),
        (not cfg.model.freeze_encoder, "needs a trained encoder (model.freeze_encoder false)"),
        (train.accum_steps == 1, "needs train.accum_steps 1 (the next replay overwrites the gradients)"),
        (not train.fsdp, "not with train.fsdp"),
        (not (enc.gradient_checkpointing or train.grad_checkpointing), "not with the encoder's gradient checkpointing"),
    ]
    blockers = [msg for ok, msg in checks if not ok]
    if device is not None:
        where = where_blocker(enc.attn_backend, enc.attn_dropout, enc.pos_enc == "wenet", train.precision, device,
                              world_size)
        blockers += [where] if where else []
    return blockers


def resolve_encoder_graphs(cfg: Config, device: torch.device, world_size: int,
                           sized_eagerly: bool = False) -> Optional[str]:
    """``train.encoder_graphs auto`` -> ``true`` where the replay can run on ``device`` with
    ``world_size`` processes, else ``false``, in place; the sentence saying which and why (None: not
    auto). ``sized_eagerly``: batch sizes were searched under a memory cap with eager steps
    (west-benchmark --memory_budget), so the replay's own memory would come on top: ``false``."""
    if cfg.train.encoder_graphs != "auto":
        return None
    blockers = encoder_graph_blockers(cfg, device, world_size)
    if sized_eagerly:
        blockers.insert(0, "--memory_budget sizes eager steps, and the replay's memory would come on top; "
                           "--train.encoder_graphs true replays anyway")
    if device.type != "cuda":   # elsewhere the blocks would run padded and eagerly: slower, for tests
        blockers.insert(0, f"needs CUDA, the run is on {device.type}")
    cfg.train.encoder_graphs = "false" if blockers else "true"
    why = blockers[0] if blockers else "the Conformer's blocks replayed from CUDA graphs"
    return f"train.encoder_graphs auto: {cfg.train.encoder_graphs} ({why})"
