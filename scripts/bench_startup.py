"""Usage: python scripts/bench_startup.py [--runs N] [--first-step [--recipe R] [--runs-first-step 3]]

Times `areal --help` against `python -c pass` (the interpreter's own start-up), both as
fresh processes, and prints the median of each and their ratio. The target is under 0.5 s
for `areal --help`; torch, transformers and sglang must not be imported by it.

--first-step also times what a user waits for at `make demo`: from the command to its
first step line (`[areal] step 1/...`), for `areal train RECIPE` (recipes/tiny_cpu.yaml)
with its model already cached, the median of --runs-first-step runs (each stopped with
SIGINT once the line shows), against `python -c "import torch, transformers"` (what one
process pays before any work). The target is 4.5 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def median_seconds(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def seconds_to_first_step(recipe: str) -> float:
    """One `areal train RECIPE` from its start to its first step line; then stopped."""
    with tempfile.TemporaryDirectory(prefix="areal-bench-startup-") as root:
        argv = [
            str(Path(sys.executable).parent / "areal"), "train", recipe,
            f"cluster.fileroot={root}", "logging.display=plain", "logging.tensorboard=false",
        ]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("[areal] step 1/"):
                took = time.perf_counter() - start
                break
        else:
            raise RuntimeError(f"areal train {recipe} ended (exit {proc.wait()}) before step 1")
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
        return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--first-step", action="store_true", help="also time command -> step 1")
    parser.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    parser.add_argument("--runs-first-step", type=int, default=3)
    args = parser.parse_args()
    areal = Path(sys.executable).parent / "areal"
    baseline = median_seconds([sys.executable, "-c", "pass"], args.runs)
    helped = median_seconds([str(areal), "--help"], args.runs)
    print(f"python -c pass : {baseline * 1000:7.1f} ms")
    print(f"areal --help   : {helped * 1000:7.1f} ms")
    print(f"ratio          : {helped / baseline:7.2f}x   (target: areal --help < 500 ms)")
    if not args.first_step:
        return
    imports = median_seconds(
        [sys.executable, "-c", "import torch, transformers.models.llama.modeling_llama"],
        args.runs_first_step,
    )
    firsts = [seconds_to_first_step(args.recipe) for _ in range(args.runs_first_step)]
    first = statistics.median(firsts)
    print(f"import torch + transformers' Llama : {imports:6.2f} s (one process)")
    print(
        f"areal train {args.recipe} -> step 1 : {first:6.2f} s median of "
        f"{', '.join(f'{t:.2f}' for t in firsts)} ({first / imports:.1f}x the imports; "
        "target 4.5 s)"
    )


if __name__ == "__main__":
    main()
