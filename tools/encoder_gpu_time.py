#!/usr/bin/env python3
"""The Conformer's blocks alone at train.encoder_graphs' static shape: eager, then replayed from
CUDA graphs. Per variant: forward and backward ms (the host's in brackets), kernels per forward +
backward and their summed time, the idle time in the span, the costliest kernels; with --compiled,
the same for the blocks compiled in place (as train.compile does), launched and replayed; and
the blocks' eager traffic and FLOPs against the device's copy bandwidth and matrix-product rate,
measured here; and the depthwise convolution alone over the replay's buffer, as the convolution
kernel and as shifted products (west.lab.encoder_time). Utterance lengths are drawn AIShell-like (west.data.workloads), in encoder frames,
until the real rows fill --fill of the --rows. On a CPU the replay and the kernel columns are left
out. Not a test.

    python tools/encoder_gpu_time.py --config recipes/aishell/conf/seed_gpu.yaml --out encoder_time.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from west.bench.peak import matmul_peak
from west.data.workloads import aishell_like_durations
from west.lab.encoder_time import (
    attention_flops,
    copy_bandwidth,
    depthwise_table,
    depthwise_times,
    eager_blocks,
    table,
    time_variant,
    traffic,
)
from west.models.config import ConformerConfig
from west.models.conformer import ConformerEncoder
from west.models.static_encoder import StaticBlocks, StaticShape
from west.shapes import PackExtent
from west.train.compile import compile_regions
from west.train.config import TrainConfig
from west.train.encoder_graphs import encoder_shape, static_encoder_for

CONF = Path(__file__).resolve().parents[1] / "recipes" / "aishell" / "conf"


class Holder(nn.Module):
    """What static_encoder_for reads: a model with an ``encoder``."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder


def lengths(fill: int, longest: int = 0, seed: int = 0, frames_per_s: float = 25.0) -> list[int]:
    """AIShell-like utterances (west.data.workloads) in encoder frames (40 ms each after 4x
    subsampling), each at most ``longest`` (when set), until ``fill`` rows are taken (the last cut to fit)."""
    frames = (aishell_like_durations(fill // 25 + 8, seed) * frames_per_s).astype(int)   # more than enough
    if longest:
        frames = np.minimum(frames, longest)
    ends = np.minimum(np.cumsum(frames), fill)
    return [int(n) for n in np.diff(ends, prepend=0) if n > 0]


def planned_shape(rows: int, segments: int, max_len: int, lens: list[int]) -> StaticShape:
    """The static shape at ``rows``, its slots and bound as given or, where 0, planned from ``lens``
    as west-train plans them from its packs (west.train.encoder_graphs.encoder_shape)."""
    train = TrainConfig(encoder_graph_rows=rows, encoder_graph_segments=segments, encoder_graph_max_len=max_len)
    return encoder_shape(train, rows, 1, PackExtent(sum(lens), len(lens), max(lens)))[0]


def padded(encoder: ConformerEncoder, shape: StaticShape, precision: str, rows: torch.Tensor,
           lens: list[int]) -> tuple[StaticBlocks, tuple]:
    """The blocks at ``shape`` (captured on CUDA) and ``rows`` padded to it, x requiring grad."""
    static = static_encoder_for(Holder(encoder), shape, precision, rows.device)
    static.stack.autocast = torch.bfloat16 if precision == "bf16" else None   # the capture sets it; eager too
    padded_rows = static.inputs(rows, lens)
    if isinstance(padded_rows, str):
        raise SystemExit(f"[encoder_gpu_time] {len(lens)} utterances of {sum(lens):,} rows do not fit {shape} "
                         f"({padded_rows}): give more --rows or --segments")
    x, *rest = padded_rows
    return static, (x.detach().requires_grad_(True), *rest)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONF / "seed_gpu.yaml"), help="a run YAML: its model.encoder")
    p.add_argument("--rows", type=int, default=11264,
                   help="the static shape's rows (train.encoder_graph_rows; the built-in corpus's plan: 11,264)")
    p.add_argument("--fill", type=int, default=9650, help="real rows in the pack (seed corpus: about 9,650)")
    p.add_argument("--segments", type=int, default=0,
                   help="segment slots (train.encoder_graph_segments); 0: planned from this pack, as west-train does")
    p.add_argument("--max_len", type=int, default=0,
                   help="the longest utterance (train.encoder_graph_max_len); 0: planned from this pack")
    p.add_argument("--baseline", default="", metavar="SEGMENTS:MAX_LEN",
                   help="also the blocks padded to these slots and bound (256:1024 before they were planned), "
                        "replayed on CUDA, eager elsewhere")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--compiled", action="store_true", help="also the blocks compiled (inductor), then replayed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None, help="JSON of every figure")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    section = yaml.safe_load(Path(a.config).read_text())["model"]["encoder"]
    if section.get("pos_enc") != "wenet":   # the replay's route: WeNet's term folded into q and k
        print(f"[encoder_gpu_time] model.encoder.pos_enc {section.get('pos_enc')} -> wenet (the replayed route)")
        section = {**section, "pos_enc": "wenet"}
    if not cuda:   # the kernel's torch reference, which has no dropout (west.models.conformer.encoder_backend)
        section = {**section, "attn_backend": "varlen", "attn_dropout": 0.0}
    encoder = ConformerEncoder(ConformerConfig.from_dict(section)).to(device).train()
    precision = "bf16" if cuda else "fp32"
    lens = lengths(min(a.fill, a.rows), a.max_len)
    shape = planned_shape(a.rows, a.segments, a.max_len, lens)
    dtype = torch.bfloat16 if cuda else torch.float32   # the subsampling's output under bf16 autocast
    rows = torch.randn(sum(lens), encoder.output_dim, device=device, dtype=dtype)
    grad = torch.randn(a.rows, encoder.output_dim, device=device, dtype=dtype)
    static, args = padded(encoder, shape, precision, rows, lens)   # on CUDA: captured (replay)
    params = [q for q in static.stack.parameters() if q.requires_grad]
    inputs = [args[0]]

    def clear() -> None:
        for t in (*inputs, *params):
            t.grad = None

    def eager() -> torch.Tensor:   # not static.stack(*args): once captured, the module's forward is the replay
        return eager_blocks(static, args)

    variants = {"eager, padded to the static shape": time_variant(eager, grad, clear, device, a.repeats)}
    if cuda:
        variants["replayed (train.encoder_graphs)"] = time_variant(lambda: static.replay(*args), grad, clear,
                                                                   device, a.repeats)
    if a.baseline:   # the same rows in the fixed slots and bound the replay used before they were planned
        segments, max_len = (int(v) for v in a.baseline.split(":"))
        other, other_args = padded(encoder, StaticShape(a.rows, segments, max_len), precision, rows, lens)
        inputs.append(other_args[0])
        run = other.replay if cuda else other.stack
        variants[f"{'replayed' if cuda else 'eager'} in {segments} segments of at most {max_len:,}"] = time_variant(
            lambda: run(*other_args), grad, clear, device, a.repeats)
    conv = encoder.blocks[0].conv
    length = a.rows + conv.pad * (shape.segments - 1)   # the replay's convolution buffer: rows and zero gaps
    depthwise = depthwise_times(conv.depthwise, length, dtype, a.repeats)
    moved = traffic(lambda: (clear(), eager().backward(grad)))   # the eager blocks', before any compiling
    clear()
    with FlopCounterMode(display=False) as fc:   # the products; the varlen attention is opaque to it
        eager().backward(grad)
    if a.compiled:   # in place, as train.compile does; the warm-up calls compile
        compile_regions(encoder)
        variants["compiled"] = time_variant(eager, grad, clear, device, a.repeats)
        if cuda:   # captured again: the graphs record inductor's kernels
            compiled = static_encoder_for(Holder(encoder), shape, precision, device)
            variants["compiled, replayed"] = time_variant(lambda: compiled.replay(*args), grad, clear, device,
                                                          a.repeats)
    cu = args[2].tolist()
    floors = {**moved, "flops": fc.get_total_flops() + attention_flops(cu, encoder.output_dim),
              "copy_gb_s": copy_bandwidth(device) if cuda else None,
              "matmul_tflop_s": matmul_peak(device)["tflops"] if cuda else None}
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"### The encoder's {len(encoder.blocks)} blocks on {name}: {a.rows:,} rows in {shape.segments} segments "
          f"of at most {shape.max_seqlen:,}, {sum(lens):,} real in {len(lens)} utterances, {precision}\n")
    print(table(variants, floors))
    print("\n" + depthwise_table(depthwise, conv.depthwise.in_channels, length, dtype))
    if a.out:
        a.out.write_text(json.dumps({"device": name, "rows": a.rows, "segments": shape.segments,
                                     "max_len": shape.max_seqlen, "real_rows": sum(lens), "utterances": len(lens),
                                     "variants": variants, "floors": floors, "depthwise": depthwise}, indent=1),
                         encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
