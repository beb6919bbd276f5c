"""``python -m west.bin.benchmark``: the seed table (static / dynamic / pack) on this machine.

Trains the same initial model on the same N utterances in every batch mode and prints
the seed's table plus the compute each mode performs and the operators it dispatches; writes
OUT_DIR/benchmark.{json,md,png}. With ``--memory_budget 24GiB`` every mode first gets the largest
size that fits (the seed's method) and the seed's table leads: time for 10,000 utterances, MFU.
See west/bench/benchmark.py for what is measured and docs/benchmarks.md for results.

    python -m west.bin.benchmark --config recipes/aishell/conf/tiny_cpu.yaml \\
        --model.llm.path exp/tiny_llm --data data/train/data.list --num_utts 200 --out_dir exp/benchmark
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence


def build_arg_parser() -> argparse.ArgumentParser:
    from west.bench.modes import ALL_MODES, DEFAULT_MODES, WHISPER_PADDED  # heavy

    p = argparse.ArgumentParser(prog="west-benchmark", description=__doc__.split("\n\n")[0],
                                epilog="Any config key can be overridden as --section.key VALUE "
                                       "(e.g. --model.llm.path DIR), as in west-train.")
    p.add_argument("--config", required=True, help="training YAML (model, data, train sections)")
    p.add_argument("--data", required=True, help="jsonl data list to draw the utterances from")
    p.add_argument("--num_utts", type=int, required=True, help="N: utterances trained on in every mode")
    p.add_argument("--out_dir", required=True, help="writes benchmark.json, benchmark.md, benchmark.png")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated, from {','.join(ALL_MODES)},{WHISPER_PADDED} (default: {','.join(DEFAULT_MODES)}, "
                        "plus whisper_padded_30s with an encoder that has a 30 s window: Whisper, Qwen2-Audio)")
    p.add_argument("--batch_size", type=int, default=32, help="static batch size (seed: 32)")
    p.add_argument("--max_tokens_in_batch", type=int, default=4096, help="dynamic budget (seed: 4096)")
    p.add_argument("--pack_tokens", type=int, default=8192, help="pack row length (seed: 8192)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per mode; the median is reported")
    p.add_argument("--warmup_steps", type=int, default=1, help="untimed steps before every timed pass")
    p.add_argument("--seed", type=int, default=0, help="utterance draw, model init, data order")
    p.add_argument("--profile", choices=["auto", "always", "never"], default="auto",
                   help="torch.profiler comparison of pack against static / encoder padded: auto = when the "
                        "measured speed-up is below 95%% of the FLOP prediction")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--memory_budget", default=None,
                   help="the seed's method: first search every mode's largest size that fits this budget "
                        "(24GiB, 20GB, 512MiB; 'card' = the CUDA card's size; on a CPU a budget on live tensor "
                        "bytes), then time every mode at its size and print the seed's table (time for 10,000 "
                        "utterances, utilisation, TFLOP/s, MFU, peak memory, dispatched ops)")
    p.add_argument("--search_granularity", type=int, default=128,
                   help="with --memory_budget: the token sizes are searched to this many tokens (batch size: to 1)")
    p.add_argument("--count_ops", action=argparse.BooleanOptionalAction, default=True,
                   help="count the aten operators every mode dispatches per step (one more pass per mode)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = build_arg_parser().parse_known_args(argv)
    from west.config import ConfigError, load_config, split_overrides  # heavy
    from west.ranks import cuda_allocator_defaults, resolved_device  # heavy
    from west.train.encoder_graphs import resolve_encoder_graphs  # heavy

    cuda_allocator_defaults()

    try:
        cfg = load_config(args.config, split_overrides(rest))
        if args.num_utts < 1 or args.repeats < 1 or args.warmup_steps < 0:
            raise ConfigError("--num_utts and --repeats must be >= 1, --warmup_steps >= 0")
        if not Path(args.data).is_file():
            raise ConfigError(f"--data: no such file: {args.data}")
        from west.bench.modes import DEFAULT_MODES, WHISPER_PADDED, standard_modes  # heavy
        from west.models.encoders import encoder_class, encoder_type  # heavy

        windowed = encoder_class(cfg.model.encoder.type).window_mode   # an encoder with a 30 s window
        names = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else (
            [*DEFAULT_MODES, WHISPER_PADDED] if windowed else list(DEFAULT_MODES))
        if WHISPER_PADDED in names and not windowed:
            raise ConfigError(f"--modes {WHISPER_PADDED} needs an encoder with a 30 s window (model.encoder.type "
                              "whisper or qwen2_audio)")
        modes = standard_modes(names, args.batch_size, args.max_tokens_in_batch, args.pack_tokens,
                               encoder_type(cfg.model.encoder.type).title)
        if args.memory_budget is not None:
            from west.bench.sizing import check_budget  # heavy

            check_budget(args.memory_budget, resolved_device(cfg.train.device))
            if args.search_granularity < 1:
                raise ConfigError("--search_granularity must be >= 1")
    except (ConfigError, ValueError) as e:
        print(f"west-benchmark: error: {e}", file=sys.stderr)
        return 2

    import torch  # heavy

    from west.bench.benchmark import run_benchmark  # heavy
    from west.bench.modes import select_utterances  # heavy
    from west.bench.report import machine, save  # heavy
    from west.models.llm import load_tokenizer  # heavy
    from west.train.build import build_model  # heavy

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = resolved_device(cfg.train.device)
    note = resolve_encoder_graphs(cfg, torch.device(device), 1, sized_eagerly=args.memory_budget is not None)
    if note:
        print(f"west-benchmark: {note}", flush=True)
    env = machine(device)
    subset = out / "bench_data.list"
    try:
        keys = select_utterances(args.data, args.num_utts, subset, args.seed)
    except ValueError as e:
        print(f"west-benchmark: error: {e}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(cfg.model.llm.path)
    model = build_model(cfg.model, args.seed)
    from west.bench.benchmark import ModeOutOfMemory  # heavy
    from west.bench.memory_search import NothingFits  # heavy
    from west.bench.sizing import find_sizes, run_within_budget  # heavy

    budget, requested = None, modes
    if args.memory_budget is not None:
        try:
            modes, budget = find_sizes(model, tokenizer, cfg.data, cfg.train, str(subset), modes, device,
                                       args.memory_budget, args.search_granularity, args.seed)
        except NothingFits as e:
            print(f"west-benchmark: error: --memory_budget {args.memory_budget}: {e}", file=sys.stderr)
            return 1
    prepared: dict = {}   # a retry after a timed pass ran out of memory keeps the other modes' batches and counts

    def run(sized: list) -> dict:
        return run_benchmark(model, tokenizer, cfg.data, cfg.train, str(subset), sized, args.repeats,
                             args.warmup_steps, args.seed, device, args.profile, args.count_ops, prepared=prepared)

    try:
        res = run_within_budget(run, requested, modes, budget)
    except ModeOutOfMemory as e:
        print(f"west-benchmark: error: {e}; give that mode a smaller size, or --memory_budget to search one",
              file=sys.stderr)
        return 1
    except NothingFits as e:
        print(f"west-benchmark: error: --memory_budget {args.memory_budget}: {e}", file=sys.stderr)
        return 1
    env["load_after"] = [round(x, 2) for x in os.getloadavg()]
    res.update(num_utts=len(keys), repeats=args.repeats, warmup_steps=args.warmup_steps, env=env,
               command=" ".join(["python -m west.bin.benchmark", *(argv if argv is not None else sys.argv[1:])]),
               data=str(args.data), config=args.config)
    if budget is not None or device == "cuda":   # the seed's table (MFU against a peak measured here): on a
        from west.bench.benchmark import add_efficiency  # heavy                  GPU the peak takes a second
        from west.bench.peak import run_peak  # heavy

        add_efficiency(res, run_peak(device, cfg.train.precision))
    if budget is not None:
        res["memory_budget"] = budget
    text = save(res, out)
    print(text, flush=True)
    print(f"[benchmark] the full report (every table, the step's host split, allocator events, trials): "
          f"{out / 'benchmark.md'}; also {out / 'benchmark.json'}, {out / 'benchmark.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
