"""Processes, free ports and gloo groups for multi-rank tests."""
from __future__ import annotations

import multiprocessing
import os
import socket
from typing import Callable

import torch

# Children start from a fork server: a clean process that imports torch, transformers and west's
# trainer once, then forks each child from its single thread. A plain fork from the pytest worker
# copied a process that had run other tests (torch's thread pool, tqdm's monitor thread) and once
# killed a rank with SIGSEGV; spawning imports everything again in every child. On a machine with a
# GPU children are spawned: autograd's device threads would make a forked child fail on its first
# backward. Either way targets and their arguments must pickle (module-level functions).
START_METHOD = "spawn" if torch.cuda.is_available() else "forkserver"
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp",
           "transformers", "west.train.loop", "west.checkpoint.training"]
multiprocessing.set_forkserver_preload(PRELOAD)


def run_child(target: Callable, *args) -> int:
    """``target(*args)`` in one child process (START_METHOD); its exit code (-9: killed by SIGKILL)."""
    child = multiprocessing.get_context(START_METHOD).Process(target=target, args=args)
    child.start()
    child.join()
    return child.exitcode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60) -> None:
    """torchrun-style env for spawned test workers, then west's own init."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    from west.train.distributed import init_distributed

    return init_distributed("cpu", timeout_s=timeout_s)


def _traced(rank: int, worker: Callable, *args) -> None:
    """``worker(rank, *args)`` with Python's fault handler on: a rank that crashes in C (a SIGSEGV)
    prints every thread's Python stack to stderr, which the failing test shows."""
    import faulthandler
    import sys

    faulthandler.enable(file=sys.stderr, all_threads=True)
    worker(rank, *args)


def run_ranks(worker: Callable, *args, world: int = 2) -> None:
    """``worker(rank, world, port, *args)`` in ``world`` processes joined on a free port; raises
    if any of them fails."""
    import torch.multiprocessing as mp  # heavy

    mp.start_processes(_traced, args=(worker, world, free_port(), *args), nprocs=world, join=True,
                       start_method=START_METHOD)


def rank_results(out_dir, world: int = 2, stem: str = "rank") -> list:
    """What each rank saved as ``out_dir/{stem}{rank}.pt`` (weights_only)."""
    from pathlib import Path

    return [torch.load(Path(out_dir) / f"{stem}{r}.pt", weights_only=True) for r in range(world)]
