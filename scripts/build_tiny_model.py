"""Usage: python scripts/build_tiny_model.py OUT_DIR [--preset tiny|small] [--seed N]

Builds a randomly initialised Llama-style model with a locally trained tokenizer, offline,
into OUT_DIR (atomically). Rebuilding the same preset and seed into the same folder is a
no-op; any other existing OUT_DIR is refused. Prints the folder path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from areal_cli.models.tiny_model import PRESETS, build_tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = build_tiny_model(args.out_dir, args.preset, args.seed)
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
