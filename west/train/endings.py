"""An epoch in which every utterance was skipped is an error, not a run that "finished".

With every wav of a list unreadable, the planned batches become dummies (equal steps on every
rank), the steps compute nothing and the run used to end "done after 3 steps, 0 bad steps"
with exit status 0. Bad input is a counted skip, but a run that trained on nothing must say so.
"""
from __future__ import annotations

from west.config import ConfigError
from west.data.stats import SKIP_CATEGORIES


def require_trained(summary: dict) -> None:
    """Raise ConfigError naming the skip counts when the epoch of ``summary`` (EpochTotals.summary,
    skips summed over ranks) trained nothing although inputs were skipped: no utterance counted and
    no step that had a label token (a step of dummy batches is an empty one)."""
    skipped = {k: v for k, v in (summary.get("skipped_inputs") or {}).items() if k in SKIP_CATEGORIES and v}
    trained_steps = summary.get("steps", 0) - summary.get("empty_steps", 0)
    if summary.get("utterances", 0) or trained_steps > 0 or not skipped:
        return
    counts = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
    raise ConfigError(f"epoch {summary['epoch']}: every utterance of run.train_data was skipped ({counts}): "
                      "nothing was trained; fix the list (the warnings above name each line)")
