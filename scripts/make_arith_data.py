"""Usage: python scripts/make_arith_data.py [OUT_DIR] [--seed N]

Writes the bundled synthetic arithmetic task used by recipes/tiny_cpu.yaml and
recipes/tiny_sft.yaml: OUT_DIR/arith_train.jsonl and OUT_DIR/arith_test.jsonl (default
OUT_DIR: recipes/data). Each line is {"prompt": "What is 3+5?", "answer": "8"}; the reward
checks the number. It also writes OUT_DIR/arith_pref_{train,test}.jsonl for
recipes/tiny_rm.yaml: {"prompt": ..., "chosen": "8", "rejected": "7"}, a wrong sum rejected. Sums of two numbers below 10 keep the task learnable by a
~1M-parameter model on a CPU. The rows come from areal_cli.models.demo_model, which writes
the same files (seed 0) when it builds builtin:tiny-arith.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from areal_cli.models.demo_model import write_arith_data, write_preference_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="recipes/data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in write_arith_data(out, args.seed) + write_preference_data(out, args.seed):
        print(f"wrote {path} ({len(path.read_text().splitlines())} rows)")


if __name__ == "__main__":
    main()
