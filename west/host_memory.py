"""Keep freed large host buffers in glibc's heap, so CPU steps stop page-faulting them back in.

glibc serves a block above its mmap threshold (adaptive, at most 32 MiB) with fresh pages and
returns them to the kernel on free. A CPU training step whose activations pass that size (an
8k-token pack's MLP activation: 8184 × 1152 fp32 = 38 MB) then pays one page fault per 4 KiB on
every allocation: 0.66 M faults and 13 % of a pass in the LLM-heavy benchmark (docs/benchmarks.md).
A fixed mmap threshold of 1 GiB puts those blocks in the heap, and no trimming keeps the heap's
freed top (glibc returns it once it passes the trim threshold, and the next step faults it back
in); the process keeps its peak heap instead of shrinking after it, as with jemalloc or tcmalloc.
"""
from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD = 1 << 30
NEVER = -1  # M_TRIM_THRESHOLD -1: never trim (mallopt(3))
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameter numbers (malloc.h)
USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_done: str | None = None


def keep_freed_host_memory() -> str:
    """Raise glibc's mmap threshold and stop heap trimming, once per process; returns what was done.

    Left alone: other C libraries, an allocator preloaded by the user (jemalloc, tcmalloc, ...),
    and any malloc setting the user made through the environment."""
    global _done
    if _done is None:
        _done = _tune()
    return _done


def _tune() -> str:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "host allocator: left as is (not glibc)"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return f"host allocator: left as is (LD_PRELOAD={preload})"
    user = [k for k in USER_KNOBS if k in os.environ]
    user += ["GLIBC_TUNABLES"] if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") else []
    if user:
        return f"host allocator: left as is ({', '.join(user)} set)"
    libc = ctypes.CDLL("libc.so.6")
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, NEVER)):
        return "host allocator: glibc refused the thresholds, left as is"
    return "host allocator: glibc reuses freed blocks up to 1 GiB (mmap threshold 1 GiB, heap never trimmed)"
