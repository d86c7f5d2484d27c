"""Usage: python scripts/make_demo_model.py OUT_DIR [--seed N] [--steps N] [--smoothing F] [--force]

Builds the demo's starting model (`builtin:tiny-arith`, see
areal_cli/models/demo_model.py) into OUT_DIR and prints its accuracy. `areal train`
builds the same model by itself (and caches it); this script is for inspecting or
re-tuning the warm-up (scripts/tune_demo_rl.py runs RL on its output in-process).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from areal_cli.models.demo_model import build_arith_demo_model
from areal_cli.rollout.rewards import numeric


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=1, help="model init and warm-up seed")
    parser.add_argument("--steps", type=int, default=250, help="warm-up optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--smoothing", type=float, default=0.45, help="target mass spread over the digits and EOS"
    )
    parser.add_argument(
        "--correct-frac", type=float, default=1.0, help="fraction of correct targets (label noise)"
    )
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per problem")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.out_dir.exists() and not args.force:
        print(f"error: {args.out_dir} exists (use --force to replace it)", file=sys.stderr)
        return 1
    start = time.monotonic()
    info = build_arith_demo_model(
        args.out_dir,
        numeric,
        args.seed,
        args.steps,
        args.batch_size,
        args.lr,
        args.smoothing,
        args.correct_frac,
        args.eval_samples,
    )
    for line in info["sampled_examples"]:
        print(f"  sample: {line}")
    print(
        f"warm-up: {args.steps} steps, loss {info['first_loss']:.3f} -> {info['final_loss']:.3f}, {time.monotonic() - start:.1f} s"
    )
    print(
        f"accuracy over the 100 problems: sampled (T=1.0, {args.eval_samples}/problem) {info['sampled_accuracy']:.3f}, "
        f"greedy {info['greedy_accuracy']:.3f}, p(correct then EOS) {info['p_correct_then_eos']:.3f}"
    )
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
