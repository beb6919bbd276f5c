"""The host's time per dispatched operator on this machine, apart from any model (west.lab.launch_floor).

    python tools/launch_floor.py [--device cuda] [--step_ops 5515] [--out floor.json]

With ``--step_ops N`` (a step's launching operators, e.g. west-benchmark's ``ops`` per step
less its views), it also says how long a host-paced step of N operators takes at each floor.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from west.lab.launch_floor import WORKLOADS, floor_table, measure
from west.ranks import cuda_allocator_defaults


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ops", type=int, default=2000, help="operators per timed call, about")
    p.add_argument("--width", type=int, default=64, help="the autograd chains' layer width")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step_ops", type=int, default=0, help="a step's launching operators, to scale the floor to")
    p.add_argument("--out", help="JSON file for the rows")
    a = p.parse_args(argv)
    cuda_allocator_defaults()   # the allocator west's commands run with
    device = torch.device(a.device)
    rows = [measure(w, device, a.ops, a.width, a.repeats) for w in WORKLOADS]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nhost time per dispatched operator on {name}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads (medians of {a.repeats} calls)\n")
    print(floor_table(rows))
    by = {r["workload"]: r for r in rows}
    line = (f"[launch_floor] {name}: {by['launch']['host_us_per_op']:.1f} µs per bare launch, "
            f"{by['autograd']['host_us_per_op']:.1f} with autograd, {by['autocast']['host_us_per_op']:.1f} "
            f"with autocast too")
    if a.step_ops:
        lo, hi = sorted(a.step_ops * by[w]["host_us_per_op"] / 1e3 for w in ("autograd", "autocast"))
        line += f"; a host-paced step of {a.step_ops:,} operators: {lo:.0f}-{hi:.0f} ms"
    print("\n" + line)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": name, "torch": torch.__version__, "step_ops": a.step_ops,
                                           "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
