#!/usr/bin/env python3
"""Recipe stage 8: untrained / trained / averaged error rate per decoded set, as a table and
RUN/{cer,wer}_summary.json.

Reads RUN/decode_{untrained,trained,averaged}_SET/NAME.json (written by tools/compute_cer.py
--json, NAME = --metric); the averaged column appears when stage 7 decoded every set with
RUN/avg_N. The line above the table names the normalizer the scores were computed after.

    python tools/error_rate_summary.py exp/tiny_cpu dev test                 # CER (AIShell)
    python tools/error_rate_summary.py exp/tiny_cpu dev_clean test_clean --metric wer
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

WHICH = ("untrained", "trained", "averaged")


def averaged_label(run_dir: Path, name: str) -> str:
    """'averaged CER (3 best by cv_cer: steps 400, 350, 300)' from the newest avg_*/averaged.json."""
    found = sorted(run_dir.glob("avg_*/averaged.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        return f"averaged {name}"
    r = json.loads(found[-1].read_text(encoding="utf-8"))
    how = f"best by {r['metric']}" if r["mode"] == "best" else "last"
    return f"averaged {name} ({len(r['steps'])} {how}: steps {', '.join(map(str, r['steps']))})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("sets", nargs="*", help="decoded sets, e.g. dev test")
    p.add_argument("--metric", choices=("cer", "wer"), default="cer",
                   help="which score files to read (decode_*/METRIC.json) and name")
    a = p.parse_args(argv)
    metric, name = a.metric, a.metric.upper()
    which = [w for w in WHICH if w != "averaged" or all(
        (a.run_dir / f"decode_averaged_{x}" / f"{metric}.json").is_file() for x in a.sets)]
    summary = {x: {w: json.loads((a.run_dir / f"decode_{w}_{x}" / f"{metric}.json").read_text()) for w in which}
               for x in a.sets}
    normalizers = sorted({r[w].get("normalizer", "none") for r in summary.values() for w in which})
    print(f"[run.sh] {name} after the text normalizer {' / '.join(normalizers)} "
          "(west.infer.scoring; the result files keep the raw texts)")
    labels = {"untrained": f"untrained {name} (step 0)", "trained": f"trained {name} (newest checkpoint)",
              "averaged": averaged_label(a.run_dir, name)}
    print("| set | " + " | ".join(labels[w] for w in which) + " |\n|---" + "|---" * len(which) + "|")
    for x, r in summary.items():
        print(f"| {x} | " + " | ".join(f"{100 * r[w]['rate']:.2f}%" for w in which) + " |")
    if any(r["trained"]["rate"] >= r["untrained"]["rate"] for r in summary.values()):
        print("[run.sh] NOTE: the trained model is not better than the untrained one on every set "
              "(see docs/getting_started.md, 'What the default run costs')")
    (a.run_dir / f"{metric}_summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
