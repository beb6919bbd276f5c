"""Which rank this process is and what the ranks agree on: device choice, rank queries and the
small host collectives that checkpoints, training and evaluation all use.

Shared by ``west.train`` (the loop) and ``west.checkpoint`` (collective saves), so neither
package imports the other for them. In a single process (no process group) every collective
is the identity; ``west.train.distributed`` creates the process group.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from west.schema import ConfigError


def cuda_allocator_defaults() -> None:
    """Expandable segments for the CUDA caching allocator, unless ``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF`` says otherwise: batches of varying shape fragment fixed-size segments
    (one H100 run under a 24 GiB cap ran out with 0.9 GiB reserved but unallocated). Takes effect
    only before the process's first CUDA allocation, hence at the top of each command."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def disable_cudnn_attention() -> None:
    """Keep torch's ``scaled_dot_product_attention`` off cuDNN's fused attention for the whole process:
    cuDNN builds a graph for every new shape, and padded batches bring new shapes nearly every step
    (static batches trained 1.86x slower with it on one H200, docs/benchmarks.md); the flash and
    memory-efficient kernels take any shape as it comes. Packed rows on CUDA's default routes run
    varlen kernels and never reach SDPA's chooser; segment SDPA and padded batches do."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto`` -> this rank's GPU if CUDA is available, else CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but CUDA is not available")
    return torch.device("cuda", local_rank)


def resolved_device(requested: str) -> str:
    """What ``train.device`` will be, cpu or cuda, checked while the config is: an error names the key."""
    try:
        return pick_device(requested).type
    except RuntimeError:
        raise ConfigError(f"train.device: {requested} requested but CUDA is not available") from None


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


def host_group():
    return _host_group


def set_host_group(group) -> None:
    """The gloo group the host collectives use under nccl (None: the default group)."""
    global _host_group
    _host_group = group


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


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies the module in place)."""
    return getattr(model, "module", model)


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
