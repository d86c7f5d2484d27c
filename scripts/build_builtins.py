"""Usage: python scripts/build_builtins.py [NAME ...] [--seed 1]

Builds builtin models into the cache ($AREAL_CACHE_DIR, default ~/.cache/areal) as the
first run that names them would, and returns at once for those already built. `make test`
runs it first for the builtins the suite trains from (tiny, tiny-arith, small: ~30 s on 2
cores from an empty cache), so that no test waits on another worker's build while three
share two cores (a fresh clone's suite spent ~6 CPU-minutes on that).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SUITE = ("tiny", "tiny-arith", "small")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(SUITE), metavar="NAME")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    from areal_cli.config.schema import BUILTIN_MODELS
    from areal_cli.launch.builtins import cached

    unknown = [n for n in args.names if n not in BUILTIN_MODELS]
    if unknown:
        parser.error(f"unknown builtin(s) {unknown}; the builtins are {', '.join(BUILTIN_MODELS)}")
    for name in args.names:
        start = time.perf_counter()
        path = cached(name, args.seed, print)
        print(f"builtin:{name} (seed {args.seed}) at {path} ({time.perf_counter() - start:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
