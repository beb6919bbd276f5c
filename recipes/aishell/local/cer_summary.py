#!/usr/bin/env python3
"""Stage 8: untrained / trained / averaged CER per decoded set, as a table and RUN/cer_summary.json.

Reads RUN/decode_{untrained,trained,averaged}_SET/cer.json (written by tools/compute_cer.py
--json); the averaged column appears when stage 7 decoded every set with RUN/avg_N.

    python local/cer_summary.py exp/tiny_cpu dev test
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

WHICH = ("untrained", "trained", "averaged")


def averaged_label(run_dir: Path) -> str:
    """'averaged CER (3 best by cv_cer: steps 400, 350, 300)' from the newest avg_*/averaged.json."""
    found = sorted(run_dir.glob("avg_*/averaged.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        return "averaged CER"
    r = json.loads(found[-1].read_text(encoding="utf-8"))
    how = f"best by {r['metric']}" if r["mode"] == "best" else "last"
    return f"averaged CER ({len(r['steps'])} {how}: steps {', '.join(map(str, r['steps']))})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("sets", nargs="*", help="decoded sets, e.g. dev test")
    a = p.parse_args(argv)
    which = [w for w in WHICH if w != "averaged" or all(
        (a.run_dir / f"decode_averaged_{x}" / "cer.json").is_file() for x in a.sets)]
    summary = {x: {w: json.loads((a.run_dir / f"decode_{w}_{x}" / "cer.json").read_text()) for w in which}
               for x in a.sets}
    labels = {"untrained": "untrained CER (step 0)", "trained": "trained CER (newest checkpoint)",
              "averaged": averaged_label(a.run_dir)}
    print("| set | " + " | ".join(labels[w] for w in which) + " |\n|---" + "|---" * len(which) + "|")
    for x, r in summary.items():
        print(f"| {x} | " + " | ".join(f"{100 * r[w]['rate']:.2f}%" for w in which) + " |")
    if any(r["trained"]["rate"] >= r["untrained"]["rate"] for r in summary.values()):
        print("[run.sh] NOTE: the trained model is not better than the untrained one on every set "
              "(see docs/getting_started.md, 'What the default run costs')")
    (a.run_dir / "cer_summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
