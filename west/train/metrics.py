"""Per-step records: DIR/train_log.jsonl, TensorBoard, a tqdm bar, epoch summaries, audit.

Rank 0 writes the global numbers (already summed over ranks by the step).
train_log.jsonl holds one line per step and one line per dev evaluation; the
latter carry ``"event": "eval"`` (readers of step lines skip lines with "event").
DIR/epochs.jsonl holds one machine-readable summary per epoch; the console gets
the same as a sentence with rounded figures (:func:`epoch_sentence`).
With ``audit`` every rank also writes DIR/audit/rank{R}.jsonl: the utterance
keys it trained on at each step, so exactly-once use of a corpus is checkable.
On resume, lines after the checkpoint's step are dropped from both files, so
the logs read like one uninterrupted run.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from west.batch import COUNTER_NAMES
from west.train.log_writes import guarded


def peak_memory_mb(device: torch.device, reset: bool = True) -> float:
    """CUDA: peak allocated by the caching allocator since the last call. CPU: the
    process's peak resident set size so far (Linux ru_maxrss, never reset)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kb / 1024 if sys.platform != "darwin" else rss_kb / 2**20


def peak_reserved_mb(device: torch.device) -> dict:
    """CUDA: ``{"peak_reserved_mb": ...}``, the most the caching allocator held from the device since
    the last reset (allocated bytes plus its cache and fragmentation: what a smaller card must hold);
    read it before :func:`peak_memory_mb` resets. Other devices: nothing."""
    if device.type != "cuda":
        return {}
    return {"peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}


# torch.cuda.memory_stats counters -> train_log / benchmark names. A device allocation or free
# (cudaMalloc / cuMemMap, cudaFree / cuMemUnmap) can stall the GPU's queue; a retry flushes the
# cache after a failed allocation and synchronises the device. In a steady state all are 0 per step.
ALLOCATOR_EVENTS = {"num_device_alloc": "device_allocs", "num_device_free": "device_frees",
                    "num_alloc_retries": "alloc_retries"}


class AllocatorEvents:
    """CUDA caching-allocator events since the previous :meth:`read` (one step, or one timed
    pass): non-zero counts under a tight memory cap mean the allocator, not the kernels, costs
    time. ``stats`` stands in for ``torch.cuda.memory_stats`` in tests; other devices report
    nothing, and counters this torch does not keep are left out rather than read as 0."""

    def __init__(self, device: torch.device, stats: Optional[Callable[[], dict]] = None) -> None:
        if stats is None and device.type == "cuda":
            stats = lambda: torch.cuda.memory_stats(device)   # noqa: E731
        self._stats = stats
        self._last = self._counts()

    def _counts(self) -> dict[str, int]:
        if self._stats is None:
            return {}
        raw = self._stats()
        return {name: int(raw[key]) for key, name in ALLOCATOR_EVENTS.items() if key in raw}

    def read(self) -> dict[str, int]:
        now = self._counts()
        out = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        return out


def step_record(step: int, epoch: int, result: Any, wall_s: float, peak_mem_mb: float,
                hw: Optional[dict] = None) -> dict:
    """One train_log.jsonl line from a StepResult (west.train.step) and timings."""
    c = result.counters
    wall = max(wall_s, 1e-9)
    rec = {
        "step": step, "epoch": epoch, "status": result.status,
        "loss": result.loss, "acc": result.n_correct / result.n_tokens if result.n_tokens else math.nan,
        "lr": result.lr, "grad_norm": result.grad_norm,
        **{name: int(c.get(name, 0)) for name in COUNTER_NAMES},
        "step_time_s": wall_s,
        "utts_per_s": c.get("utterances", 0) / wall,
        "tokens_per_s": c.get("real_llm_tokens", 0) / wall,
        "computed_tokens_per_s": c.get("computed_llm_tokens", 0) / wall,
        "llm_fill": _ratio(c.get("real_llm_tokens", 0), c.get("computed_llm_tokens", 0)),
        "enc_fill": _ratio(c.get("real_enc_frames", 0), c.get("computed_enc_frames", 0)),
        "peak_mem_mb": peak_mem_mb,
        "time": time.time(),
    }
    for key in ("launch_s", "sync_wait_s", "update_s"):   # where the host spent the step
        value = getattr(result, key, math.nan)
        if math.isfinite(value):
            rec[key] = value
    aux = getattr(result, "aux", None) or {}
    if aux.get("ctc_utts"):   # hybrid CTC training: the two parts of the loss
        rec["ce"] = aux["ce_sum"] / result.n_tokens if result.n_tokens else math.nan
        rec["ctc_per_utt"] = aux["ctc_sum"] / aux["ctc_utts"]
        rec["ctc_infeasible"] = int(aux.get("ctc_infeasible", 0))
    rec.update(hw or {})
    return rec


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _json_line(rec: dict) -> str:
    # NaN is not JSON: write null so every line parses with any reader.
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
    return json.dumps(clean, ensure_ascii=False) + "\n"


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep only lines with step <= max_step (lines written after the resumed checkpoint go)."""
    if not path.is_file():
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                if int(json.loads(line)["step"]) <= max_step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by the crash
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


class MetricsLogger:
    """Step/epoch logging for one rank (only rank 0 writes the global logs). A failed write
    raises :class:`west.train.log_writes.LogWriteError` (disk full: the previous checkpoint is kept)."""

    @guarded("train_log.jsonl, tensorboard/ or audit/")
    def __init__(self, output_dir: str | os.PathLike, rank: int = 0, *, start_step: int = 0,
                 total_steps: Optional[int] = None, tensorboard: bool = True,
                 progress_bar: bool = True, audit: bool = False, log_every: int = 10) -> None:
        self.dir = Path(output_dir)
        self.rank = rank
        self.log_every = log_every
        self._log = self._tb = self._bar = self._audit = None
        self._cv: dict = {}  # the latest dev figures, shown in the progress bar
        self._postfix: dict = {}
        if audit:
            audit_path = self.dir / "audit" / f"rank{rank}.jsonl"
            audit_path.parent.mkdir(parents=True, exist_ok=True)
            truncate_jsonl(audit_path, start_step)
            self._audit = open(audit_path, "a", encoding="utf-8")
        if rank != 0:
            return
        log_path = self.dir / "train_log.jsonl"
        truncate_jsonl(log_path, start_step)
        self._log = open(log_path, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only when used

            self._tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=start_step + 1)
        if progress_bar:
            from tqdm import tqdm  # heavy

            self._bar = tqdm(total=total_steps or None, initial=start_step, unit="step",
                             dynamic_ncols=True, file=sys.stderr)

    @guarded("train_log.jsonl or tensorboard/")
    def log_step(self, rec: dict) -> None:
        if self._log is None:
            return
        self._log.write(_json_line(rec))
        self._log.flush()
        step = rec["step"]
        if self._tb is not None:
            for k, v in rec.items():
                if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"train/{k}", v, step)
        if self._bar is not None:
            self._bar.update(1)
            self._postfix = {"loss": f"{rec['loss']:.4f}", "utts_s": f"{rec['utts_per_s']:.1f}"}
            self._bar.set_postfix({**self._postfix, **self._cv}, refresh=False)
        elif step % self.log_every == 0:
            parts = f" (ce {rec['ce']:.4f}, ctc/utt {rec['ctc_per_utt']:.2f})" if "ce" in rec else ""
            print(f"step {step} epoch {rec['epoch']} loss {rec['loss']:.4f}{parts} lr {rec['lr']:.3g} "
                  f"grad_norm {rec['grad_norm']:.3g} utts/s {rec['utts_per_s']:.1f} "
                  f"tokens/s {rec['tokens_per_s']:.0f}", flush=True)

    @guarded("train_log.jsonl or tensorboard/")
    def log_eval(self, rec: dict) -> None:
        """One dev evaluation: a train_log.jsonl line, eval/ scalars, the bar's postfix or a sentence."""
        if self._log is None:
            return
        self._log.write(_json_line(rec))
        self._log.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if k.startswith("cv_") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"eval/{k[3:]}", v, rec["step"])
        self._cv = {"cv_loss": _fmt(rec.get("cv_loss"))}
        for key in ("cv_cer", "cv_wer"):
            if key in rec:
                self._cv[key] = _pct(rec[key])
        if self._bar is not None:
            self._bar.set_postfix({**self._postfix, **self._cv})
        else:
            print(f"step {rec['step']}: {dev_sentence(rec)} ({duration(rec.get('eval_s', 0))})", flush=True)

    @guarded("audit/")
    def log_audit(self, step: int, epoch: int, keys: Iterable[str]) -> None:
        if self._audit is not None:
            self._audit.write(json.dumps({"step": step, "epoch": epoch, "keys": list(keys)},
                                         ensure_ascii=False) + "\n")
            self._audit.flush()

    @guarded("epochs.jsonl or tensorboard/")
    def log_epoch(self, summary: dict) -> None:
        """Append an epoch summary (totals + skipped-input counts) to DIR/epochs.jsonl."""
        if self._log is None:
            return
        with open(self.dir / "epochs.jsonl", "a", encoding="utf-8") as f:
            f.write(_json_line(summary))
        (self._bar.write if self._bar is not None else print)(epoch_sentence(summary))
        if self._tb is not None:
            for k, v in summary.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "epoch" \
                        and not k.startswith("cv_"):  # dev figures: eval/ scalars already
                    self._tb.add_scalar(f"epoch/{k}", v, summary["epoch"])

    @guarded("train_log.jsonl, tensorboard/ or audit/")
    def close(self) -> None:
        for h in (self._log, self._audit):
            if h is not None:
                h.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        self._log = self._tb = self._bar = self._audit = None


class EpochTotals:
    """Sums of one epoch's step records, for the epoch summary."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = self.skipped_steps = self.empty_steps = 0
        self.loss_sum = 0.0
        self.tokens = 0
        self.wall_s = 0.0
        self.counters = {name: 0 for name in COUNTER_NAMES}

    def add(self, rec: dict, loss_sum: float) -> None:
        self.steps += 1
        self.skipped_steps += rec["status"] == "nonfinite"
        self.empty_steps += rec["status"] == "empty"
        if rec["status"] == "ok":
            self.loss_sum += loss_sum
            self.tokens += rec["label_tokens"]
        self.wall_s += rec["step_time_s"]
        for name in COUNTER_NAMES:
            self.counters[name] += rec[name]

    def summary(self, epoch: int, skipped_inputs: Optional[dict] = None) -> dict:
        return {"epoch": epoch, "steps": self.steps, "skipped_steps": self.skipped_steps,
                "empty_steps": self.empty_steps,
                "loss": self.loss_sum / self.tokens if self.tokens else math.nan,
                "wall_s": round(self.wall_s, 3), **self.counters,
                "skipped_inputs": dict(skipped_inputs or {})}

    def state_dict(self) -> dict:
        return dict(self.__dict__, counters=dict(self.counters))

    def load_state_dict(self, sd: dict) -> None:
        self.__dict__.update(sd)
        self.counters = dict(sd["counters"])


# ----------------------------------------------------------------------------- sentences

def _fmt(x: Optional[float]) -> str:
    """A loss for people: three significant digits."""
    return f"{x:.3g}" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def _pct(x: Optional[float]) -> str:
    return f"{100 * x:.1f} %" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def counts(skipped: Optional[dict]) -> str:
    """``{"too_long": 3}`` -> "too_long 3"; nothing -> "none"."""
    return ", ".join(f"{k} {v:,}" for k, v in sorted((skipped or {}).items()) if v) or "none"


def dev_sentence(rec: dict) -> str:
    """The dev figures of an eval record or an epoch summary, e.g.
    "dev loss 2.1, dev CER 8.5 % on 100 utterances"."""
    n_loss, n_dec = rec.get("cv_utts", 0), rec.get("cv_decoded_utts", 0)
    text = f"dev loss {_fmt(rec.get('cv_loss'))}"
    if "cv_cer" in rec:
        rates = f"dev CER {_pct(rec['cv_cer'])}" + (f", WER {_pct(rec['cv_wer'])}" if "cv_wer" in rec else "")
        text += f", {rates} on {plural(n_dec, 'utterance')}" if n_dec == n_loss else \
            f" on {plural(n_loss, 'utterance')}, {rates} on {n_dec:,}"
    else:
        text += f" on {plural(n_loss, 'utterance')}"
    if rec.get("cv_skipped_inputs"):
        text += f" (dev inputs skipped: {counts(rec['cv_skipped_inputs'])})"
    return text


def epoch_sentence(s: dict) -> str:
    """e.g. "epoch 2: 80 steps in 1.2 min, train loss 2.31 per token, 1,500 utterances;
    dev loss 2.10, dev CER 8.5 % on 100 utterances; skipped inputs: none"."""
    text = (f"epoch {s['epoch']}: {plural(s['steps'], 'step')} in {duration(s.get('wall_s', 0))}, "
            f"train loss {_fmt(s.get('loss'))} per token, {plural(s.get('utterances', 0), 'utterance')}")
    if s.get("skipped_steps"):
        text += f", {plural(s['skipped_steps'], 'bad step')} skipped"
    if "cv_loss" in s:
        text += f"; {dev_sentence(s)}"
    return text + f"; skipped inputs: {counts(s.get('skipped_inputs'))}"


def done_sentence(summary: dict) -> str:
    """west-train's last line, e.g. "done after 450 steps (6 epochs, 7.1 min); best dev CER 8.2 %
    at step 400 (checkpoint DIR/checkpoints/step_00000400); 0 bad steps"."""
    epochs, extra = summary["epoch"], summary.get("partial_epoch_steps", 0)
    span = plural(epochs, "epoch") + (f" + {plural(extra, 'step')}" if extra else "") \
        if epochs or not extra else "part of the first epoch"
    text = f"done after {plural(summary['step'], 'step')} ({span}, {duration(summary.get('wall_s', 0))})"
    best = summary.get("best")
    if best:
        cer = best.get("cv_cer")
        if best.get("metric") in ("cv_cer", "cv_wer"):
            name = best["metric"][3:].upper()
            main, other = f"dev {name} {_pct(best.get(best['metric']))}", f"loss {_fmt(best.get('cv_loss'))}"
        else:
            main, other = f"dev loss {_fmt(best.get('cv_loss'))}", f"CER {_pct(cer)}" if cer is not None else ""
        text += f"; best {main}{f' ({other})' if other else ''} at step {best['step']:,}"
        text += f" (checkpoint {best['checkpoint']})" if best.get("checkpoint") else " (checkpoint not kept)"
    elif summary.get("checkpoints"):   # fit's summary names its last save, None if it saved none (train.save_at_end)
        saved = summary.get("checkpoint", summary["checkpoints"])
        text += f"; checkpoints in {summary['checkpoints']}" if saved else "; no checkpoint saved"
    text += f"; {plural(summary.get('skipped_steps', 0), 'bad step')}"
    if summary.get("failed_saves"):
        text += f", {plural(summary['failed_saves'], 'failed checkpoint save')}"
    if summary.get("compilations"):
        text += f"; {plural(summary['compilations'], 'compiled graph')} (train.compile)"
    if summary.get("encoder_graph"):
        text += f"; {summary['encoder_graph']} (train.encoder_graphs)"
    return text
