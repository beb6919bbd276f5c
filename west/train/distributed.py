"""Process-group setup, rank helpers, model wrapping and small collectives.

One code path for every launch: a plain ``python -m west.bin.train`` is world
size 1 with no process group (every collective helper is then a no-op), and
``torchrun`` sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR which we read here.
Every collective inherits the process-group timeout, so a rank that died or
left early makes the others fail with an error instead of waiting forever.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn


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


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto`` -> this rank's GPU if CUDA is available, else CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but CUDA is not available")
    return torch.device("cuda", local_rank)


def resolved_device(requested: str) -> str:
    """What ``train.device`` will be, cpu or cuda, checked while the config is: an error names the key."""
    from west.schema import ConfigError

    try:
        return pick_device(requested).type
    except RuntimeError:
        raise ConfigError(f"train.device: {requested} requested but CUDA is not available") from None


def init_distributed(device: str = "auto", timeout_s: float = 1800) -> DistInfo:
    """Join the torchrun process group (gloo on CPU, nccl on CUDA) or run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
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
    global _host_group
    if backend == "nccl" and _host_group is None:   # collective: every rank creates it here
        _host_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def cleanup() -> None:
    global _host_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _host_group = None


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _comm_device() -> torch.device:
    """Tensors for collectives must live on CUDA with nccl, on CPU with gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_host_group = None   # gloo group for host numbers when the default backend is nccl (init_distributed)


def _all_reduce(values: Sequence[float], op: "dist.ReduceOp") -> list[float]:
    """One collective over a short vector of host numbers (float64: exact for ints < 2**53). With
    nccl it goes through a gloo group on the CPU, so it never waits on the GPU's queue."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [float(v) for v in values]
    device = torch.device("cpu") if _host_group is not None else _comm_device()
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=_host_group)
    return t.tolist()


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Sum a short vector of numbers over ranks in ONE collective."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_reduce_sum_device(t: torch.Tensor) -> torch.Tensor:
    """Sum a vector that lives on the training device over ranks, without reading it back
    (the caller reads the result once). Unchanged in a single process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return t
    t = t.to(_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(values: Sequence[float]) -> list[float]:
    return _all_reduce(values, dist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on at least one rank (e.g. "I am out of data")."""
    return all_reduce_max([1.0 if flag else 0.0])[0] > 0


def all_ranks(flag: bool) -> bool:
    """True on every rank only if ``flag`` is True on all ranks (e.g. "my write succeeded")."""
    return not any_rank(not flag)


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
    from torch.distributed.fsdp import MixedPrecisionPolicy

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
        from torch.distributed.device_mesh import init_device_mesh
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
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, find_unused_parameters=find_unused_parameters)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies the module in place)."""
    return getattr(model, "module", model)


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


def sum_counts_over_ranks(counts: dict[str, int]) -> dict[str, int]:
    """Sum small {name: count} dicts whose keys may differ between ranks (epoch-end only)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return dict(counts)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(counts))
    total: dict[str, int] = {}
    for d in gathered:
        for k, v in d.items():
            total[k] = total.get(k, 0) + int(v)
    return total
