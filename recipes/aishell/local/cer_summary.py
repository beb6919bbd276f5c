#!/usr/bin/env python3
"""Stage 7: trained vs untrained CER per decoded set, as a table and RUN/cer_summary.json.

Reads RUN/decode_{trained,untrained}_SET/cer.json (written by tools/compute_cer.py --json).

    python local/cer_summary.py exp/tiny_cpu dev test
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

WHICH = ("untrained", "trained")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("sets", nargs="*", help="decoded sets, e.g. dev test")
    a = p.parse_args(argv)
    summary = {x: {w: json.loads((a.run_dir / f"decode_{w}_{x}" / "cer.json").read_text()) for w in WHICH}
               for x in a.sets}
    print("| set | untrained CER (step 0) | trained CER |\n|---|---|---|")
    for x, r in summary.items():
        print(f"| {x} | {100 * r['untrained']['rate']:.2f}% | {100 * r['trained']['rate']:.2f}% |")
    if any(r["trained"]["rate"] >= r["untrained"]["rate"] for r in summary.values()):
        print("[run.sh] NOTE: the trained model is not better than the untrained one on every set "
              "(see docs/getting_started.md, 'What the default run costs')")
    (a.run_dir / "cer_summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
