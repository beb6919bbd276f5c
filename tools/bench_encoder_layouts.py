#!/usr/bin/env python3
"""The Conformer alone, padded vs packed: CPU time, FLOPs and GFLOP/s of forward + backward.

Answers "is our padded encoder a straw man?": on the same utterances, padded work runs at
the GFLOP/s of the packed path (within noise), so a padded mode's lower GFLOP/s in the
benchmark comes from where its FLOPs fall (the encoder runs far below the LLM's GFLOP/s on
a CPU), not from a slow padded implementation. CPU time (process_time), 1 thread, min of
--repeats interleaved passes; lengths drawn like the synthesized corpus. Not a test.

    python tools/bench_encoder_layouts.py --utts 60 --config recipes/aishell/conf/tiny_cpu.yaml
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import yaml
from torch.nn.utils.rnn import pad_sequence
from torch.utils.flop_counter import FlopCounterMode

from west.bench.costs import sdpa_flops
from west.models.config import ConformerConfig
from west.models.conformer import ConformerEncoder

CONF = Path(__file__).resolve().parents[1] / "recipes" / "aishell" / "conf"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--utts", type=int, default=60, help="utterances in the batch (a pack of 8192 LLM tokens: ~60)")
    p.add_argument("--min_frames", type=int, default=150)
    p.add_argument("--max_frames", type=int, default=1000)
    p.add_argument("--config", default=str(CONF / "tiny_cpu.yaml"), help="a run YAML: its model.encoder")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(0)
    lens = [rng.randint(a.min_frames, a.max_frames) for _ in range(a.utts)]
    section = yaml.safe_load(Path(a.config).read_text())["model"]["encoder"]
    enc = ConformerEncoder(ConformerConfig.from_dict({**section, "dropout": 0.0}))
    feats = [torch.randn(n, enc.cfg.input_dim) for n in lens]
    padded, packed = pad_sequence(feats, batch_first=True), torch.cat(feats)
    cu = torch.tensor([0] + lens).cumsum(0).int()
    runs = {"packed": lambda: enc.forward_flat(packed, cu_seqlens=cu)[0],
            "padded": lambda: enc.forward_flat(padded, lengths=torch.tensor(lens))[0]}
    cpu = {k: [] for k in runs}
    for _ in range(a.repeats):
        for k, fn in runs.items():
            t0 = time.process_time()
            fn().sum().backward()
            cpu[k].append(time.process_time() - t0)
    rows = []
    for k, fn in runs.items():
        with FlopCounterMode(display=False, custom_mapping=sdpa_flops()) as fc:
            fn().sum().backward()
        flops, secs = fc.get_total_flops(), min(cpu[k])
        rows.append({"layout": k, "frames_computed": int(padded.shape[0] * padded.shape[1]) if k == "padded" else sum(lens),
                     "gflop": round(flops / 1e9, 1), "cpu_s": round(secs, 3), "gflop_per_s": round(flops / 1e9 / secs, 1)})
    print(f"| layout | fbank frames computed | GFLOP fwd+bwd | CPU s (min of {a.repeats}) | GFLOP/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['frames_computed']} | {r['gflop']} | {r['cpu_s']} | {r['gflop_per_s']} |")
    ratio = rows[1]["gflop_per_s"] / rows[0]["gflop_per_s"]
    print(f"bench_encoder_layouts: {Path(a.config).name}'s Conformer, {a.utts} utterances ({sum(lens)} real frames); "
          f"padded runs at {100 * ratio:.0f}% of the packed path's GFLOP/s")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"lengths": lens, "config": a.config, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
