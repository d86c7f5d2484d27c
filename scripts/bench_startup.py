"""Usage: python scripts/bench_startup.py [--runs N]

Times `areal --help` against `python -c pass` (the interpreter's own start-up), both as
fresh processes, and prints the median of each and their ratio. The target is under 0.5 s
for `areal --help`; torch, transformers and sglang must not be imported by it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path


def median_seconds(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description="Time `areal --help` against `python -c pass`.")
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    areal = Path(sys.executable).parent / "areal"
    baseline = median_seconds([sys.executable, "-c", "pass"], args.runs)
    helped = median_seconds([str(areal), "--help"], args.runs)
    print(f"python -c pass : {baseline * 1000:7.1f} ms")
    print(f"areal --help   : {helped * 1000:7.1f} ms")
    print(f"ratio          : {helped / baseline:7.2f}x   (target: areal --help < 500 ms)")


if __name__ == "__main__":
    main()
