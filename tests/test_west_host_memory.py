"""The glibc heap keeps freed large blocks after keep_freed_host_memory(): counted page faults, not time."""
import platform
import subprocess
import sys

import pytest

from west import host_memory

ALLOC_LOOP = """
import resource, sys, torch
if sys.argv[1] == "tuned":
    from west.host_memory import keep_freed_host_memory
    print(keep_freed_host_memory(), file=sys.stderr)
faults = []
for _ in range(32):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(48 << 18)   # 48 MiB: above glibc's largest adaptive mmap threshold (32 MiB)
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(min(faults), max(faults[-8:]))
"""
PAGES = (48 << 20) // 4096


def page_faults(mode: str) -> tuple[int, int]:
    """(fewest faults of any allocation, most faults of the last 8) over 32 allocations of 48 MiB."""
    out = subprocess.run([sys.executable, "-c", ALLOC_LOOP, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    fewest, last = out.stdout.split()
    return int(fewest), int(last)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_large_blocks_are_reused_instead_of_faulted_in_again():
    assert page_faults("default")[0] >= PAGES // 2   # every 48 MiB tensor gets fresh pages, forever
    # tuned: the heap grows for a few allocations (glibc's per-thread cache keeps small freed chunks
    # between the big ones for a while), then reuses a freed block
    assert page_faults("tuned")[1] < PAGES // 20


HEAP_SIZES = """
import ctypes, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = MallInfo2, ctypes.c_void_p, [ctypes.c_void_p]
if sys.argv[1] == "tuned":
    from west.host_memory import keep_freed_host_memory
    keep_freed_host_memory()
blocks = [libc.malloc(600 << 20) for _ in range(2)]   # never touched: no memory is used
held = libc.mallinfo2()
for b in blocks:
    libc.free(b)
freed = libc.mallinfo2()
print(held.arena >> 20, held.hblkhd >> 20, freed.arena >> 20)
"""


def heap_sizes(mode: str) -> tuple[int, int, int]:
    """MiB of (heap, mmapped blocks) holding two 600 MiB blocks, then the heap once they are freed."""
    out = subprocess.run([sys.executable, "-c", HEAP_SIZES, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    heap, mapped, heap_after = map(int, out.stdout.split())
    return heap, mapped, heap_after


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_big_blocks_live_in_a_heap_that_is_never_trimmed():
    heap, mapped, _ = heap_sizes("default")
    assert mapped >= 1200 and heap < 600            # glibc's default: each block its own mmap
    heap, mapped, heap_after = heap_sizes("tuned")
    assert mapped == 0 and heap >= 1200             # tuned: in the heap...
    assert heap_after >= 1200                       # ...and still there once freed (a trim threshold would return it)


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}])
def test_user_choices_are_left_alone(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    note = host_memory._tune()
    assert "left as is" in note and next(iter(env)) in note


def test_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "_done", None)
    monkeypatch.setattr(host_memory, "_tune", lambda: calls.append(1) or "tuned")
    assert host_memory.keep_freed_host_memory() == host_memory.keep_freed_host_memory() == "tuned"
    assert calls == [1]
