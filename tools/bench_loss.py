"""The LLM's loss over its vocabulary alone, per implementation: time, memory, agreement with plain.

At the seed's shapes the loss is a linear head over Qwen2's 151,936 tokens on a pack's label rows
(H 1,536; some 1,500 to 3,000 rows per pack of 8,192). Marked west-train steps gave it 8.0 ms of
the H100's forward and 12.5 ms of its backward per pack (docs/benchmarks.md, sixth run), for
about 2 ms of matrix products. This runs :func:`west.models.loss.linear_cross_entropy` alone on
one set of inputs with every implementation importable here (``plain``, ``chunked``, and on CUDA
Liger-Kernel and cut-cross-entropy when installed): forward, forward + backward, the memory it
adds, and how far its loss, argmax count and ``hidden`` gradient are from ``plain``'s. The
forward runs with gradients on, as in training: ``chunked`` and Liger-Kernel compute the gradients
there, so forward + backward is the column to compare.

Configurations (``--configs``): ``bf16`` = bf16 hidden and head under bf16 autocast (the seed's
frozen bf16 LLM), ``autocast`` = float32 tensors under bf16 autocast, ``fp32`` = float32, no
autocast; ``--weights frozen,trains`` says whether the head's weight requires a gradient.
On CUDA, times are drained CUDA-event milliseconds and memory is the allocator's peak above the
inputs; on a CPU, process CPU milliseconds and the growth of the peak resident set (reset with
/proc/self/clear_refs). A benchmark: it prints a table and writes JSON, and asserts no time.

    python tools/bench_loss.py [--rows 1500,3000] [--hidden 1536] [--vocab 151936]
        [--configs bf16] [--weights frozen] [--impls plain,chunked,liger,cce] [--chunk_rows 512]
        [--device cuda] [--repeats 5] [--out loss.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from west.models import loss as loss_mod
from west.models.loss import linear_cross_entropy

CONFIGS = {   # name -> (tensor dtype, bf16 autocast)
    "bf16": (torch.bfloat16, True),
    "autocast": (torch.float32, True),
    "fp32": (torch.float32, False),
}


def available_impls(wanted: list[str], device: torch.device) -> tuple[list[str], dict]:
    """The implementations of ``wanted`` that can run here, and why each other one cannot."""
    run, skipped = [], {}
    for impl in wanted:
        if impl in loss_mod._LIBRARIES:
            if device.type != "cuda":
                skipped[impl] = "CUDA only"
                continue
            if loss_mod._library_fn(impl) is None:
                skipped[impl] = f"{loss_mod._LIBRARIES[impl][2]} is not importable"
                continue
        run.append(impl)
    return run, skipped


def make_inputs(rows: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden, weight, target): weights scaled so the logits spread as a trained head's do
    (a few units), and one target in three set to its row's argmax (n_correct neither 0 nor N)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (3.0 / hidden ** 0.5)
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[::3] = (h[::3] @ w.T).argmax(-1)
    return h.to(device, dtype), w.to(device, dtype), t.to(device)


class Meter:
    """Time and memory of one call on ``device``: CUDA events and the allocator's peak, or the
    process's CPU time and the peak resident set."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.t0, self.t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.base = _rss_reset()
            self.c0 = time.process_time()

    def stop(self) -> tuple[float, float]:
        """(ms, bytes added at the peak)."""
        if self.cuda:
            self.t1.record()
            torch.cuda.synchronize()
            return self.t0.elapsed_time(self.t1), torch.cuda.max_memory_allocated() - self.base
        return 1e3 * (time.process_time() - self.c0), _peak_rss() - self.base


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _rss_reset() -> int:
    """The resident set now, after resetting its recorded peak (Linux; elsewhere the peak stays)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_kib("VmRSS")


def _peak_rss() -> int:
    return _status_kib("VmHWM")


def run_once(impl: str, inputs: tuple, dtype_autocast: tuple, train_weight: bool, chunk_rows: int,
             meter: Meter, backward: bool) -> dict:
    """One forward (and backward) on fresh leaves: ms, peak bytes added, loss, count, grad_h."""
    h0, w0, t = inputs
    dtype, autocast = dtype_autocast
    h = h0.detach().clone().requires_grad_(True)
    w = w0.detach().clone().requires_grad_(train_weight)
    meter.start()
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss, correct = linear_cross_entropy(h, w, t, chunk_rows=chunk_rows, impl=impl)
    if backward:
        (loss / t.numel()).backward()   # a grad_loss of 1 / rows, as the trainer's normalised loss gives
    ms, peak = meter.stop()
    return dict(ms=ms, peak=peak, loss=float(loss.detach()), correct=int(correct), grad_h=h.grad)


def measure(impl: str, inputs: tuple, config: str, train_weight: bool, chunk_rows: int, repeats: int,
            device: torch.device) -> tuple[dict, dict]:
    """(row of the table, the first forward + backward's outputs) for one implementation."""
    meter = Meter(device)
    first = run_once(impl, inputs, CONFIGS[config], train_weight, chunk_rows, meter, backward=True)   # warm-up
    fwd = [run_once(impl, inputs, CONFIGS[config], train_weight, chunk_rows, meter, False) for _ in range(repeats)]
    both = [run_once(impl, inputs, CONFIGS[config], train_weight, chunk_rows, meter, True) for _ in range(repeats)]
    row = dict(impl=impl, forward_ms=statistics.median(r["ms"] for r in fwd),
               forward_backward_ms=statistics.median(r["ms"] for r in both),
               peak_bytes=max(r["peak"] for r in both))
    return row, first


def agreement(ref: dict, got: dict) -> dict:
    """The loss's relative difference, the argmax counts' equality and grad_h's largest difference
    relative to plain's largest entry."""
    gr, gg = ref["grad_h"].float(), got["grad_h"].float()
    return dict(loss_rel_diff=abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
                correct_equal=got["correct"] == ref["correct"],
                grad_h_rel_diff=float((gg - gr).abs().max() / gr.abs().max().clamp_min(1e-30)))


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    impls, skipped = available_impls(args.impls.split(","), device)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for config in args.configs.split(","):
            inputs = make_inputs(rows, args.hidden, args.vocab, CONFIGS[config][0], device)
            for weights in args.weights.split(","):
                outputs = {}
                for impl in impls:
                    row, outputs[impl] = measure(impl, inputs, config, weights == "trains", args.chunk_rows,
                                                 args.repeats, device)
                    row.update(rows=rows, config=config, weights=weights)
                    results.append(row)
                ref = outputs.get("plain")
                for row in results[-len(impls):]:
                    row.update(agreement(ref, outputs[row["impl"]]) if ref is not None else {})
                outputs.clear()
            del inputs
    return dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, hidden=args.hidden, vocab=args.vocab, chunk_rows=args.chunk_rows,
                repeats=args.repeats, time_unit="CUDA ms" if device.type == "cuda" else "process CPU ms",
                skipped=skipped, results=results)


def table(report: dict) -> str:
    unit = report["time_unit"]
    mem = "peak memory added" if "CUDA" in unit else "peak RSS added"
    lines = [f"### the LLM's loss alone, H {report['hidden']:,}, V {report['vocab']:,}, chunk_rows "
             f"{report['chunk_rows']}, {report['device']}, torch {report['torch']} (medians of {report['repeats']})", "",
             f"| label rows | config | head weight | impl | forward ({unit}) | forward + backward ({unit}) | {mem} "
             "| loss vs plain | grad_h vs plain | argmax count = plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        diff = (f"{r['loss_rel_diff']:.1e} | {r['grad_h_rel_diff']:.1e} | {'yes' if r['correct_equal'] else 'NO'}"
                if "loss_rel_diff" in r else "n/a | n/a | n/a")
        lines.append(f"| {r['rows']:,} | {r['config']} | {r['weights']} | {r['impl']} | {r['forward_ms']:.1f} "
                     f"| {r['forward_backward_ms']:.1f} | {r['peak_bytes'] / 2**30:.2f} GiB | {diff} |")
    lines += [f"- {impl} not run: {why}" for impl, why in report["skipped"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1500,3000", help="label rows per pack, comma-separated")
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--configs", default="bf16", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--weights", default="frozen", help="frozen, trains or both, comma-separated")
    p.add_argument("--impls", default="plain,chunked,liger,cce")
    p.add_argument("--chunk_rows", type=int, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--out", default=None, help="JSON report")
    args = p.parse_args(argv)
    bad = [c for c in args.configs.split(",") if c not in CONFIGS]
    if bad:
        p.error(f"--configs: {bad} not among {list(CONFIGS)}")
    if set(args.weights.split(",")) - {"frozen", "trains"}:
        p.error(f"--weights must list frozen and/or trains; got {args.weights!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    best = {}
    for r in report["results"]:
        key = (r["rows"], r["config"], r["weights"])
        if key not in best or r["forward_backward_ms"] < best[key]["forward_backward_ms"]:
            best[key] = r
    print("fastest forward + backward: " + "; ".join(
        f"{rows:,} rows {config} {weights}: {r['impl']} {r['forward_backward_ms']:.1f} ms"
        for (rows, config, weights), r in best.items()))


if __name__ == "__main__":
    main()
