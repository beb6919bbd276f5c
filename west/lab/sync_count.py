"""Host synchronisations by source line: torch's sync debug mode warns at every operation that makes
the host wait for the GPU; :func:`count_syncs` counts those warnings, from any thread, by the
innermost line of this repository that caused them (tools/count_syncs.py over the benchmark's
step, tools/train_syncs.py over a whole west-train run)."""
from __future__ import annotations

import collections
import traceback
import warnings
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]   # the checkout holding west/


def where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of this repository, else the innermost outside torch: who asked."""
    stack = [f for f in stack if f.filename != __file__ and "/warnings.py" not in f.filename]
    ours = [f for f in stack if f.filename.startswith(str(ROOT)) and "site-packages" not in f.filename]
    others = [f for f in stack if "/torch/" not in f.filename]
    f = (ours or others or stack)[-1]
    name = str(Path(f.filename).relative_to(ROOT)) if f.filename.startswith(str(ROOT)) else f.filename
    return f"{name}:{f.lineno} ({f.name})"


def count_syncs(fn: Callable[[], object], debug_mode: Callable[[int], None]) -> collections.Counter:
    """Run ``fn`` with ``debug_mode(1)`` (torch.cuda.set_sync_debug_mode) and count its
    synchronisation warnings by :func:`where` they came from; other warnings pass on."""
    found: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            found[where(traceback.extract_stack()[:-1])] += 1
        else:
            original(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        debug_mode(1)
        try:
            fn()
        finally:
            debug_mode(0)
            warnings.showwarning = original
    return found
