#!/usr/bin/env python3
"""Plot one benchmark run: tokens/s and ITL p50 against concurrency, acceptance per draft position.

Reads a JSON written by ``scripts/benchmark.py`` and writes three PNGs (the images
``docs/benchmarks.md`` links): ``throughput.png``, ``itl_p50.png``,
``acceptance_per_position.png``. The series are built by ``bench/plots.py``.

    python scripts/plot_benchmarks.py benchmarks/results/20261122T011800Z-103579b.json --out docs/img/
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.plots import write_plots

REPO_ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="a benchmarks/results/*.json file")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "img", help="directory for the PNGs")
    args = p.parse_args()
    result = json.loads(args.result.read_text())
    for path in write_plots(result, args.out):
        print(f"[plot] {path}")


if __name__ == "__main__":
    main()
