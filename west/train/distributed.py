"""Process-group setup and model wrapping (DDP / FSDP2) for training.

Rank queries and the small collectives live in west.ranks (checkpoints use them too). One
code path for every launch: a plain ``python -m west.bin.train`` is world size 1 with no
process group (every collective helper is then a no-op), and
``torchrun`` sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR which we read here.
Every collective inherits the process-group timeout, so a rank that died or
left early makes the others fail with an error instead of waiting forever.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from west import ranks
from west.ranks import pick_device


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = ""  # "" when no process group was created

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto", timeout_s: float = 1800) -> DistInfo:
    """Join the torchrun process group (gloo on CPU, nccl on CUDA) or run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1:
        return DistInfo(0, 1, 0, dev, "")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        # gloo raises on timeout; NCCL's watchdog tears the process down (torch's default
        # TORCH_NCCL_ASYNC_ERROR_HANDLING=3) and torchrun then stops the other ranks.
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    if backend == "nccl" and ranks.host_group() is None:   # collective: every rank creates it here
        ranks.set_host_group(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    ranks.set_host_group(None)


# ----------------------------------------------------------------------------- wrapping

def fsdp_mixed_precision(precision: str):
    """FSDP2's policy for ``train.precision``: bf16 -> gather parameters in bf16 (compute and
    all-gather traffic), reduce gradients in fp32; the sharded parameters and the optimizer
    state stay fp32 (master weights). fp32 -> None (FSDP's default: no casting).

    Forward inputs are not cast (``cast_forward_inputs=False``): the step's autocast decides
    activation dtypes as it does under DDP, and finds the weights already in bf16, so nothing
    is cast twice."""
    if precision == "fp32":
        return None
    if precision != "bf16":
        raise ValueError(f"train.precision: {precision!r} is not fp32 or bf16")
    from torch.distributed.fsdp import MixedPrecisionPolicy  # heavy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)


def wrap_model(model: nn.Module, info: DistInfo, fsdp: bool = False,
               find_unused_parameters: bool = False, precision: str = "fp32") -> nn.Module:
    """DDP (default) or FSDP2 ``fully_shard`` around ``model``; unchanged when world size is 1.

    FSDP2 shards every child listed by ``model.fsdp_units()`` (e.g. the LLM's
    decoder layers and the encoder blocks) and then the root, so only one
    unit's full parameters (plus the root's) live on a device at a time; with
    ``precision="bf16"`` it gathers them in bf16 (:func:`fsdp_mixed_precision`).
    Gradients are averaged over ranks by both wrappers, which the per-token loss
    scaling relies on. Activation checkpointing must be enabled before wrapping
    (the Trainer does): the recompute then re-gathers each unit through its hooks.
    """
    model = model.to(info.device)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh  # heavy
        from torch.distributed.fsdp import fully_shard  # FSDP2 API (torch >= 2.6)

        policy = fsdp_mixed_precision(precision)
        if not dist.is_initialized():
            return model  # one process: nothing to shard across (autocast alone does bf16)
        # the run's device type, not FSDP's default (torch's accelerator): a CPU run on a GPU machine stays on CPU
        kwargs = {"mesh": init_device_mesh(info.device.type, (dist.get_world_size(),))}
        kwargs.update({"mp_policy": policy} if policy is not None else {})
        units = list(model.fsdp_units()) if hasattr(model, "fsdp_units") else []
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        return model
    if not info.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP  # heavy

    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, find_unused_parameters=find_unused_parameters)


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce for all but the last micro-batch of a step."""
    if enabled:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
