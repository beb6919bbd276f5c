"""The seed's method: every batch mode at the largest size that fits the memory budget.

For each mode, ``largest_fitting`` (west.bench.memory_search) searches the mode's size key
(``batch_size``, ``max_tokens_in_batch`` or ``pack_tokens``; the policy's ``size_key``).
One trial at size s:

1. plan and collate every batch the N utterances make in this mode at size s
   (west.bench.trial_batches, decoded once);
2. pick the worst batches: the largest in computed LLM positions, in LLM attention terms, in
   computed encoder frames and in encoder attention scores, N · longest² (usually one batch, at
   most four). A step's activation memory grows with those; weights, gradients and optimizer
   state are the same in every step;
3. from the initial weights with a fresh AdamW, run the production step
   (``west.train.step.train_step``: forward, backward, clip, AdamW) on each of them, and
   the first one again when only one was picked: the last step then carries the optimizer
   state that every step but the first carries;
4. it fits when no ``torch.OutOfMemoryError`` was raised: real on CUDA under the allocator cap
   (``set_per_process_memory_fraction``), simulated on a CPU by west.bench.memory.LiveTensorBytes.
   Between trials the weights are restored, gradients dropped and the CUDA cache emptied.
"""
from __future__ import annotations

import dataclasses
import gc
import time
from typing import Callable, Optional, Sequence

import torch

from west.bench.benchmark import ModeOutOfMemory
from west.bench.memory import (
    LiveTensorBytes,
    cuda_budget,
    fmt_bytes,
    parse_size,
    storage_bytes,
)
from west.bench.memory_search import NothingFits, largest_fitting
from west.bench.modes import Mode, model_overrides, standard_modes
from west.bench.runner import PassRunner
from west.bench.trial_batches import BatchSource, size_bounds, worst_batches
from west.data.config import DataConfig
from west.data.policies import POLICIES
from west.host_memory import keep_freed_host_memory
from west.train.config import TrainConfig

_SIZE_ARG = {"batch_size": "batch_size", "max_tokens_in_batch": "max_tokens", "pack_tokens": "pack_tokens"}


def size_key(mode: Mode) -> str:
    return POLICIES[mode.data["batch_type"]].size_key


def run_trial(runner, batches: Sequence, host_budget: Optional[int]) -> tuple[bool, int, str]:
    """Steps over ``batches`` from the initial weights: (fitted, peak bytes, OOM message or "")."""
    dev = runner.device
    cuda = dev.type == "cuda"
    opt, sched = runner.fresh(len(batches))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        tracker = None
    else:
        tensors = [*runner.model.parameters(), *runner.model.buffers(),
                   *(v for b in batches for v in vars(b).values() if isinstance(v, torch.Tensor))]
        tracker = LiveTensorBytes(host_budget, storage_bytes(tensors))
    message = ""
    try:
        if tracker is None:
            for b in batches:
                runner.step(b, opt, sched)
        else:
            with tracker:
                for b in batches:
                    runner.step(b, opt, sched)
        fitted = True
    except torch.OutOfMemoryError as e:
        fitted, message = False, str(e).strip().splitlines()[0][:300]
    peak = torch.cuda.max_memory_allocated(dev) if cuda else tracker.peak
    del opt, sched
    runner.model.zero_grad(set_to_none=True)
    runner.model.load_state_dict(runner.init)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return fitted, int(peak), message


def search_mode(runner, source: BatchSource, mode: Mode, data_conf: DataConfig, host_budget: Optional[int],
                granularity: int = 128, log: Callable[[str], None] = print) -> dict:
    """The largest size of ``mode`` that fits (module docstring); the search's record."""
    key = size_key(mode)
    base = dataclasses.replace(data_conf, **mode.data)
    lo, hi = size_bounds(source, base, key)
    gran = 1 if key == "batch_size" else granularity
    record: dict = {"key": key, "lo": lo, "hi": hi, "granularity": gran, "trials": []}

    def trial(size: int) -> bool:
        t0 = time.perf_counter()
        batches = source.batches(dataclasses.replace(base, **{key: size}))
        worst = worst_batches(batches)
        steps = [batches[i] for i in worst] + ([batches[worst[0]]] if len(worst) == 1 else [])
        with model_overrides(runner.model, mode.model):
            fitted, peak, message = run_trial(runner, steps, host_budget)
        record["trials"].append({"size": size, "fits": fitted, "peak_bytes": peak, "batches": len(batches),
                                 "worst": worst, "seconds": time.perf_counter() - t0, "oom": message})
        log(f"[benchmark] search {mode.name} {key}={size}: {'fits' if fitted else 'out of memory'}, "
            f"peak {fmt_bytes(peak)} ({len(batches)} batches, worst {worst}, {time.perf_counter() - t0:.1f} s)")
        return fitted

    try:
        res = largest_fitting(trial, lo, hi, start=int(getattr(base, key)), granularity=gran)
    except NothingFits:
        oom = next((t["oom"] for t in reversed(record["trials"]) if t["oom"]), "")
        raise NothingFits(f"mode {mode.name}: even {key}={lo} runs out of memory ({oom})") from None
    record.update(size=res.size, capped=res.capped,
                  peak_bytes=next(t["peak_bytes"] for t in record["trials"] if t["size"] == res.size))
    return record


def search_sizes(runner, source: BatchSource, modes: Sequence[Mode], data_conf: DataConfig,
                 host_budget: Optional[int], granularity: int = 128,
                 log: Callable[[str], None] = print) -> dict:
    """{mode name: its search record} for every mode."""
    return {m.name: search_mode(runner, source, m, data_conf, host_budget, granularity, log) for m in modes}


def back_off(found: dict, mode: str, share: float = 0.05) -> int:
    """``mode``'s size after its timed pass ran out of memory (a whole pass can fragment the
    allocator more than the search's worst batches did): ``share`` smaller, by at least the
    search's granularity, recorded in its search record. NothingFits below the search's floor."""
    r = found[mode]
    gran = r["granularity"]
    new = r["size"] - max(gran, int(r["size"] * share) // gran * gran)
    if new < r["lo"]:
        raise NothingFits(f"mode {mode}: its timed pass ran out of memory down to {r['key']}={r['size']}")
    r.setdefault("backed_off", []).append(r["size"])
    r.update(size=new, capped=False)
    return new


def run_within_budget(run: Callable[[list[Mode]], dict], requested: Sequence[Mode], modes: list[Mode],
                      budget: Optional[dict], log: Callable[[str], None] = print) -> dict:
    """``run(modes)``; under a budget (:func:`find_sizes`' record), a mode whose timed pass runs
    out of memory is run again :func:`back_off` smaller until it fits (NothingFits below its floor)."""
    while True:
        try:
            return run(modes)
        except ModeOutOfMemory as e:
            if budget is None:
                raise
            found = budget["search"][e.mode]
            old = found["size"]
            back_off(budget["search"], e.mode)
            log(f"[benchmark] {e}; {e.mode} again at {found['key']} {found['size']} (was {old})")
            modes = sized_modes(requested, budget["search"], budget["text"])


def sized_modes(modes: Sequence[Mode], found: dict, budget_text: str) -> list[Mode]:
    """``modes`` at the sizes found, each configuration saying so."""
    out = []
    for m in modes:
        r = found[m.name]
        sized = standard_modes([m.name], **{_SIZE_ARG[r["key"]]: r["size"]})[0]
        note = ("all utterances in one batch: the largest the search allows" if r["capped"]
                else f"largest under {budget_text}")
        if r.get("backed_off"):
            note += f"; backed off from {r['backed_off'][0]} after a timed pass ran out of memory"
        out.append(dataclasses.replace(sized, data={**m.data, r["key"]: r["size"]},
                                       configuration=f"{sized.configuration} ({note})"))
    return out


def check_budget(text: str, device: str) -> Optional[int]:
    """Bytes of ``--memory_budget`` (None for ``card``: the CUDA card's size); ValueError naming the flag."""
    if text == "card":
        if not str(device).startswith("cuda"):
            raise ValueError("--memory_budget card needs a CUDA device; on a CPU give a size (e.g. 2GiB): "
                             "a budget on live tensor bytes")
        return None
    return parse_size(text, "--memory_budget")


def find_sizes(model: torch.nn.Module, tokenizer, data_conf: DataConfig, train: TrainConfig, data_list: str,
               modes: Sequence[Mode], device: str, budget_text: str, granularity: int = 128, seed: int = 0,
               log: Callable[[str], None] = print) -> tuple[list[Mode], dict]:
    """Search every mode's largest size under ``budget_text`` (``24GiB``, or ``card``); returns the
    modes at those sizes and the record of the search. On CUDA the allocator cap stays set
    afterwards, so the timed passes run under the same budget."""
    dev = torch.device(device)
    budget = check_budget(budget_text, device)
    if dev.type == "cuda":
        cap = cuda_budget(dev, budget)
        host_budget = None
    else:
        keep_freed_host_memory()
        cap, host_budget = {"budget": budget, "card": None, "fraction": None}, budget
    log(f"[benchmark] memory budget {budget_text}: searching the largest size of every mode")
    model.to(dev)
    runner = PassRunner(model, train, dev, seed)
    source = BatchSource(data_list, tokenizer, model.cfg.speech_shape(), seed)
    found = search_sizes(runner, source, modes, data_conf, host_budget, granularity, log)
    del runner
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return sized_modes(modes, found, budget_text), {"text": budget_text, **cap, "search": found}
