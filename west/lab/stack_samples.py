"""Where the launching thread's time goes, from py-spy's native stack samples (``--format raw``).

cProfile (west.lab.host_profile) sees Python functions only, slows what it measures, and
shows an operator's C++ side as one builtin. A sampling profiler with native frames
(``py-spy record --native``) costs the process little and sees through to torch's dispatcher,
autocast, autograd, the CUDA driver's launch path and libc. Its raw output is one line per
distinct stack: ``thread (TID): NAME;frame;frame;... COUNT``, the root first. A frame is
``function (file.py:line)`` for Python code and ``symbol (library)`` for native code.

Only samples inside a step are kept (``train_step``, or ``queue_train_step`` with
``train.late_readback``; the model's build and the warm-up pass are not the step). On CUDA autograd
runs the backward on a thread of its own, which py-spy does not see; ``tools/profile_step.py
--single_thread_backward`` runs it on the launching thread instead. ``focus`` functions get their
time split by what they call and by where the samples end: which of a short phase's few operators,
or which wait, holds the host.
"""
from __future__ import annotations

import collections
import re
from dataclasses import dataclass

STEP_FRAMES = ("train_step (west/train/step.py", "queue_train_step (west/train/late_readback.py")

# Named parts of the host's work, by a substring of any frame of a sample (a sample counts once per part).
CATEGORIES = {
    "CUDA driver and runtime (launches, copies, events)": ("(libcuda.so", "(libcudart.so"),
    "autocast's casts": ("autocast",),
    "autograd engine (backward)": ("torch::autograd::Engine::",),
    "caching allocators": ("CachingAllocator", "CachingHostAllocator"),
    "waiting for the GIL": ("take_gil",),
    "garbage collector": ("gc_collect",),
}


# Native leaf frames of a thread waiting for work (a condition, a queue, a timer, a socket), by symbol with
# libc's decorations off: these names, or a name starting with one of IDLE_PREFIXES. With --idle py-spy
# samples every thread at every tick, so a thread's other samples are its busy time (waits for a lock,
# such as take_gil or __lll_lock_wait, count as busy: they are contention).
IDLE_NAMES = {"read", "recv", "recvmsg", "poll", "ppoll", "select", "pselect", "epoll_wait", "accept", "accept4",
              "nanosleep", "clock_nanosleep", "usleep", "sleep", "waitpid", "wait4", "sigtimedwait"}
IDLE_PREFIXES = ("pthread_cond_", "futex", "do_futex_wait", "sem_wait", "sem_timedwait", "sem_clockwait",
                 "PyThread_acquire_lock")   # threading's locks: Event.wait, Queue.get, Condition.wait


@dataclass(frozen=True)
class Stack:
    thread: str
    frames: tuple[str, ...]   # root first
    count: int


def parse_raw(text: str) -> list[Stack]:
    """py-spy's raw (collapsed) output -> stacks; lines without a count are refused by line number."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"line {n}: not 'frame;frame;... COUNT': {line[:80]!r}")
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith("thread (") else ""
        out.append(Stack(thread, tuple(frames[1:] if thread else frames), int(count)))
    return out


def library(frame: str) -> str:
    """``python`` for a Python frame, else the native library's stem (``libtorch_cpu``), ``?`` if unknown."""
    where = frame[frame.rfind("(") + 1:-1] if frame.endswith(")") else "?"
    if ".py:" in where or where.startswith("<"):
        return "python"
    return where.split(".so")[0] or "?"


def _function(frame: str) -> str:
    """A Python frame without its line: ``queue_step (west/train/step.py)``."""
    name, _, where = frame.rpartition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where.endswith(")") and ":" in where else frame


def in_step(stacks: list[Stack], frames: tuple[str, ...] = STEP_FRAMES) -> list[Stack]:
    return [s for s in stacks if any(f.startswith(frames) for f in s.frames)]


def focused(stacks: list[Stack], name: str) -> tuple[collections.Counter, collections.Counter]:
    """Samples under the function ``name`` (``Projector.forward``): counts by the frame it called
    (below its innermost call; ``(own)`` where it is the leaf) and by leaf frame."""
    callees, leaves = collections.Counter(), collections.Counter()
    for s in stacks:
        at = [i for i, f in enumerate(s.frames) if f.startswith(name + " (")]
        if not at:
            continue
        i = at[-1]
        callees[_function(s.frames[i + 1]) if i + 1 < len(s.frames) else "(own)"] += s.count
        leaves[s.frames[-1]] += s.count
    return callees, leaves


CONTENDED = ("take_gil", "mutex_lock", "__lll_lock_wait")   # frames of a wait for a lock another thread holds


def idle(frames: tuple[str, ...]) -> bool:
    """A sample of a thread waiting for work: its innermost named native frame (raw addresses, a
    stripped libc's, skipped) is one of :data:`IDLE_NAMES` or :data:`IDLE_PREFIXES`, with no wait
    for a contended lock (:data:`CONTENDED`: Python's own lock ends in a futex too) on the way."""
    named = [f for f in frames if not f.startswith("0x")]
    if not named or library(named[-1]) == "python" or any(c in f for f in frames for c in CONTENDED):
        return False
    name = re.sub(r"^_*(GI_+|libc_+)?", "", named[-1].split(" (")[0]).split("@")[0]
    return name in IDLE_NAMES or name.startswith(IDLE_PREFIXES)


def threads(stacks: list[Stack], rate_hz: float, top: int = 3) -> list[dict]:
    """Every thread of the recording (the whole run, not only the steps), busiest first: seconds
    sampled, seconds busy (samples not :func:`idle`) and where it is busy (its ``top`` leaf frames).
    Which thread besides the launching one works while the step runs (a pin-memory thread
    unpickling batches, a sampler in the driver) and so may hold Python's lock or a driver's."""
    sampled, busy, leaves = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    for s in stacks:
        name = s.thread or "(no thread frame)"
        sampled[name] += s.count
        if s.frames and not idle(s.frames):
            busy[name] += s.count
            leaves[name][s.frames[-1]] += s.count
    rows = [{"thread": name, "sampled_s": n / rate_hz, "busy_s": busy[name] / rate_hz,
             "busy_in": [(leaf, c / rate_hz) for leaf, c in leaves[name].most_common(top)]}
            for name, n in sampled.items()]
    return sorted(rows, key=lambda r: -r["busy_s"])


def summarize(stacks: list[Stack], rate_hz: float, steps: int, top: int = 20,
              focus: tuple[str, ...] = ()) -> dict:
    """Milliseconds per step (samples / rate / steps) of the step's samples: own time by library
    and by leaf frame, each of :data:`CATEGORIES`, west's and transformers' Python functions with
    their callees, and each ``focus`` function's time by callee and by leaf (:func:`focused`)."""
    if rate_hz <= 0 or steps <= 0:
        raise ValueError("rate_hz and steps must be positive")
    kept = in_step(stacks)
    per_step = 1e3 / rate_hz / steps
    total = sum(s.count for s in kept)
    by_lib, by_leaf, by_part, by_func = (collections.Counter() for _ in range(4))
    for s in kept:
        leaf = s.frames[-1]
        by_lib[library(leaf)] += s.count
        by_leaf[leaf] += s.count
        for part, marks in CATEGORIES.items():
            if any(m in f for f in s.frames for m in marks):
                by_part[part] += s.count
        for f in {_function(f) for f in s.frames if "(west/" in f or "(transformers/" in f}:
            by_func[f] += s.count
    for f in [f for f, v in by_func.items() if v >= 0.99 * total]:   # the step's own frames: all of it
        del by_func[f]

    def ms(counter: collections.Counter, n: int = top) -> list[tuple[str, float]]:
        return [(k, v * per_step) for k, v in counter.most_common(n)]
    focus_ms = {}
    for name in focus:
        callees, leaves = focused(kept, name)
        focus_ms[name] = {"ms_per_step": sum(callees.values()) * per_step, "callees": ms(callees, 8),
                          "leaves": ms(leaves, 8)}
    return {"steps": steps, "rate_hz": rate_hz, "samples": total, "samples_outside_steps": sum(s.count for s in stacks) - total,
            "ms_per_step": total * per_step, "by_library": ms(by_lib), "by_leaf": ms(by_leaf),
            "categories": [(k, by_part.get(k, 0) * per_step) for k in CATEGORIES], "python": ms(by_func),
            "focus": focus_ms, "threads": threads(stacks, rate_hz)}


def table(res: dict) -> str:
    """Markdown tables of :func:`summarize`'s result."""
    def rows(title: str, items: list[tuple[str, float]]) -> list[str]:
        share = res["ms_per_step"] or 1.0
        out = [f"| {title} | ms per step | share |", "|---|---|---|"]
        out += [f"| `{name[:110]}` | {v:.1f} | {100 * v / share:.0f} % |" for name, v in items]
        return out + [""]
    head = (f"{res['samples']} samples in {res['steps']} steps at {res['rate_hz']:.0f} Hz: {res['ms_per_step']:.1f} ms "
            f"per step sampled in train_step ({res['samples_outside_steps']} samples outside the steps left out)")
    focus = []
    for name, f in res.get("focus", {}).items():
        focus += [f"`{name}`: {f['ms_per_step']:.1f} ms per step", ""]
        focus += rows(f"`{name}` calls", f["callees"]) + rows(f"`{name}`'s samples end in", f["leaves"])
    threads = ["| thread (whole recording) | busy s | sampled s | busy in |", "|---|---|---|---|"]
    threads += [f"| `{t['thread'][:60]}` | {t['busy_s']:.1f} | {t['sampled_s']:.1f} | "
                + "; ".join(f"`{leaf[:60]}` {sec:.1f} s" for leaf, sec in t["busy_in"]) + " |"
                for t in res.get("threads", [])]
    return "\n".join([head, ""] + rows("library (own time)", res["by_library"]) + rows("part (with callees)", res["categories"])
                     + rows("frame (own time)", res["by_leaf"]) + rows("west / transformers function (with callees)",
                                                                       res["python"]) + focus + threads).rstrip()
