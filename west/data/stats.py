"""Skipped-input bookkeeping: every dropped utterance is counted by category.

Bad input never crashes an epoch and is never lost silently: the stage that
rejects a sample raises ``SkipSample`` naming the category, the pipeline counts
it here, logs one warning naming the list file and line (capped per category),
and the loader prints ``summary()`` at the end of the epoch.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Optional

logger = logging.getLogger("west.data")

# Why an utterance may be skipped (each has a test).
SKIP_CATEGORIES = (
    "malformed_line",   # list line is not valid JSON / lacks required fields / wrong types
    "bad_encoding",     # non-UTF-8 bytes in a list line or transcript
    "missing_file",     # audio, features or shard file does not exist
    "corrupt_audio",    # the file exists but cannot be decoded (or a shard is unreadable)
    "truncated_audio",  # a WAV holds fewer sample bytes than its header announces (cut short)
    "empty_audio",      # zero samples
    "empty_text",       # empty or whitespace-only transcript / assistant turn
    "too_short",        # below min_duration, or too few frames for one encoder frame
    "too_long",         # above max_duration, or longer than pack_tokens / max_tokens_in_batch
)
# Things that happened but lost nothing (reported with the skips).
EVENT_NAMES = (
    "plan_overflow",    # metadata under-estimated a planned pack; the batch got an extra row
    "dummy_batches",    # planned batches whose samples were all bad (a dummy kept steps equal)
)


class SkipSample(Exception):
    """Raised by a pipeline stage to drop one sample; ``category`` is in SKIP_CATEGORIES."""

    def __init__(self, category: str, message: str):
        if category not in SKIP_CATEGORIES:
            raise ValueError(f"unknown skip category {category!r}")
        super().__init__(message)
        self.category = category
        self.message = message


class DataStats:
    """Counts skips and events; hands out deltas so worker processes can report them."""

    def __init__(self, max_warnings: int = 20):
        self.max_warnings = max_warnings
        self.counts: Counter = Counter()
        self._warned: Counter = Counter()
        self._delta: Counter = Counter()

    def skip(self, category: str, where: str, why: str) -> None:
        """Count one skipped sample and warn (at most ``max_warnings`` per category)."""
        if category not in SKIP_CATEGORIES:
            raise ValueError(f"unknown skip category {category!r}")
        self._add(category)
        if self._warned[category] < self.max_warnings:
            self._warned[category] += 1
            extra = " (further warnings of this kind suppressed)" if self._warned[category] == self.max_warnings else ""
            logger.warning("skipping %s [%s]: %s%s", where, category, why, extra)

    def event(self, name: str, where: str = "", why: str = "") -> None:
        if name not in EVENT_NAMES:
            raise ValueError(f"unknown event {name!r}")
        self._add(name)
        if why and self._warned[name] < self.max_warnings:
            self._warned[name] += 1
            logger.warning("%s [%s]: %s", where, name, why)

    def add_counts(self, counts: dict) -> None:
        """Add counts already reported elsewhere (e.g. list parsing at start-up)."""
        for k, v in counts.items():
            if v:
                self.counts[k] += v
                self._delta[k] += v

    def _add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n
        self._delta[name] += n

    def take_delta(self) -> dict:
        """Counts added since the previous call (what a worker sends with a batch)."""
        d = dict(self._delta)
        self._delta.clear()
        return d

    def merge(self, delta: Optional[dict]) -> None:
        for k, v in (delta or {}).items():
            self.counts[k] += v

    @property
    def skipped(self) -> int:
        return sum(self.counts[c] for c in SKIP_CATEGORIES)

    def as_dict(self) -> dict:
        return {k: v for k, v in sorted(self.counts.items()) if v}

    def summary(self, prefix: str = "data") -> str:
        skips = ", ".join(f"{c}={self.counts[c]}" for c in SKIP_CATEGORIES if self.counts[c])
        events = ", ".join(f"{e}={self.counts[e]}" for e in EVENT_NAMES if self.counts[e])
        text = f"{prefix}: skipped {self.skipped} utterance(s)" + (f" ({skips})" if skips else "")
        return text + (f"; {events}" if events else "")

    def state_dict(self) -> dict:
        return dict(self.counts)

    def load_state_dict(self, state: dict) -> None:
        self.counts = Counter(state)
        self._delta.clear()

