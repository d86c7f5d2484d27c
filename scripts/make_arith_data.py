"""Usage: python scripts/make_arith_data.py [OUT_DIR] [--seed N]

Writes the bundled synthetic arithmetic task used by recipes/tiny_cpu.yaml:
OUT_DIR/arith_train.jsonl and OUT_DIR/arith_test.jsonl (default OUT_DIR: recipes/data).
Each line is {"prompt": "What is 3+5?", "answer": "8"}; the reward checks the number.
Sums of two numbers below 10 keep the task learnable by a ~1M-parameter model on a CPU.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def make_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append({"prompt": f"What is {a}+{b}?", "answer": str(a + b)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="recipes/data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for name, n in (("arith_train.jsonl", 2000), ("arith_test.jsonl", 200)):
        tmp = out / (name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in make_rows(rng, n)))
        tmp.replace(out / name)
        print(f"wrote {out / name} ({n} rows)")


if __name__ == "__main__":
    main()
