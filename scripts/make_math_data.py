"""Usage: python scripts/make_math_data.py [OUT_DIR] [--seed N] [--train N] [--test N]

Writes the bundled math word problems used by recipes/smollm2_math_cpu.yaml:
OUT_DIR/math_word_train.jsonl (500 rows) and OUT_DIR/math_word_test.jsonl (100 rows),
default OUT_DIR recipes/data. Each line is
  {"prompt": "Sam has 12 apples and gives 5 to Ana. How many apples does Sam have left?",
   "answer": "7"}
and the reward (builtin:numeric) checks the number.

Problems come from one-step (add, subtract, multiply, divide) and two-step templates with
small whole numbers (every answer is a whole number from 0 to 50): easy
enough that a 135M instruct model is sometimes right, hard enough that it is often wrong.
The output is deterministic for a given --seed; no prompt appears twice or in both files.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Sam", "Ana", "Ben", "Mia", "Leo", "Zoe", "Omar", "Lily", "Ravi", "Nina", "Tom", "Eva"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells"]

Problem = tuple[str, int]


def _two_names(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(NAMES, 2)
    return a, b


def give_away(rng: random.Random) -> Problem:
    p, q = _two_names(rng)
    item = rng.choice(ITEMS)
    a = rng.randint(4, 20)
    b = rng.randint(1, a - 1)
    return f"{p} has {a} {item} and gives {b} to {q}. How many {item} does {p} have left?", a - b


def receive(rng: random.Random) -> Problem:
    p, q = _two_names(rng)
    item = rng.choice(ITEMS)
    a, b = rng.randint(2, 15), rng.randint(2, 10)
    return f"{p} has {a} {item}. {q} gives {p} {b} more. How many {item} does {p} have now?", a + b


def groups(rng: random.Random) -> Problem:
    item = rng.choice(ITEMS)
    a, b = rng.randint(2, 10), rng.randint(2, 5)
    return f"A box holds {a} {item}. How many {item} are in {b} boxes?", a * b


def share(rng: random.Random) -> Problem:
    p = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    each, n = rng.randint(2, 10), rng.randint(2, 5)
    return (
        f"{p} shares {each * n} {item} equally among {n} friends. "
        f"How many {item} does each friend get?",
        each,
    )


def buy_then_give(rng: random.Random) -> Problem:
    p = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    a, b = rng.randint(3, 15), rng.randint(2, 10)
    c = rng.randint(1, a + b - 1)
    return (
        f"{p} has {a} {item}, buys {b} more, and then gives away {c}. "
        f"How many {item} does {p} have now?",
        a + b - c,
    )


def packs_minus(rng: random.Random) -> Problem:
    p = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    packs, per = rng.randint(2, 5), rng.randint(2, 6)
    c = rng.randint(1, packs * per - 1)
    return (
        f"{p} buys {packs} packs of {item} with {per} {item} in each pack and loses {c}. "
        f"How many {item} does {p} have left?",
        packs * per - c,
    )


def change(rng: random.Random) -> Problem:
    p = rng.choice(NAMES)
    price, n = rng.randint(1, 6), rng.randint(2, 4)
    bill = rng.choice([b for b in (10, 20, 50) if b >= price * n])
    return (
        f"A pen costs {price} dollars. {p} buys {n} pens and pays with a {bill}-dollar bill. "
        f"How many dollars of change does {p} get?",
        bill - price * n,
    )


def pages_left(rng: random.Random) -> Problem:
    p = rng.choice(NAMES)
    per_day, days = rng.randint(2, 10), rng.randint(2, 5)
    total = per_day * days + rng.randint(1, 30)
    return (
        f"A book has {total} pages. {p} reads {per_day} pages a day for {days} days. "
        f"How many pages are left to read?",
        total - per_day * days,
    )


def two_friends(rng: random.Random) -> Problem:
    p, q = _two_names(rng)
    item = rng.choice(ITEMS)
    a, b = rng.randint(2, 12), rng.randint(1, 8)
    return (
        f"{p} has {a} {item}. {q} has {b} more {item} than {p}. "
        f"How many {item} do they have together?",
        a + (a + b),
    )


ONE_STEP: list[Callable[[random.Random], Problem]] = [give_away, receive, groups, share]
TWO_STEP: list[Callable[[random.Random], Problem]] = [
    buy_then_give,
    packs_minus,
    change,
    pages_left,
    two_friends,
]


def make_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    """`n` distinct problems, about 60% one-step and 40% two-step."""
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(rows) < n:
        template = rng.choice(ONE_STEP if rng.random() < 0.6 else TWO_STEP)
        prompt, answer = template(rng)
        if prompt in seen:
            continue
        assert answer >= 0, prompt
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": str(answer)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="recipes/data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=500)
    parser.add_argument("--test", type=int, default=100)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = make_rows(random.Random(args.seed), args.train + args.test)
    splits = (
        ("math_word_train.jsonl", rows[: args.train]),
        ("math_word_test.jsonl", rows[args.train :]),
    )
    for name, part in splits:
        tmp = out / (name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in part))
        tmp.replace(out / name)
        print(f"wrote {out / name} ({len(part)} rows)")


if __name__ == "__main__":
    main()
