"""Usage: python scripts/make_demo_model.py OUT_DIR [--seed N] [--steps N] [--smoothing F] [--force]

Builds the demo's starting model (`builtin:tiny-arith`, see
areal_cli/launch/builtins.py) into OUT_DIR and prints its accuracy. It runs the same
SFT recipe (areal_cli/models/tiny_arith_sft.yaml) that `areal train` runs by itself
when a recipe first asks for builtin:tiny-arith (and then caches); the options override
its keys, for inspecting or re-tuning the warm-up (scripts/tune_demo_rl.py runs RL on
the output in-process).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from areal_cli.launch.builtins import build_arith_demo_model
from areal_cli.rollout.rewards import numeric


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=1, help="model init and data order seed")
    parser.add_argument("--steps", type=int, help="SFT steps (total_train_steps)")
    parser.add_argument("--batch-size", type=int, help="examples per step (sft.batch_size)")
    parser.add_argument("--lr", type=float, help="actor.optimizer.lr")
    parser.add_argument(
        "--smoothing", type=float, help="target mass spread over the digits and EOS"
    )
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per problem")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    args = parser.parse_args(argv)
    if args.out_dir.exists() and not args.force:
        print(f"error: {args.out_dir} exists (use --force to replace it)", file=sys.stderr)
        return 1
    keys = {
        "total_train_steps": args.steps,
        "sft.batch_size": args.batch_size,
        "actor.optimizer.lr": args.lr,
        "sft.label_smoothing": args.smoothing,
    }
    overrides = tuple(f"{k}={v}" for k, v in keys.items() if v is not None)
    start = time.monotonic()
    info = build_arith_demo_model(args.out_dir, numeric, args.seed, overrides, args.eval_samples)
    for line in info["sampled_examples"]:
        print(f"  sample: {line}")
    print(
        f"SFT: {info['steps']} steps, loss {info['first_loss']:.3f} -> {info['final_loss']:.3f}, "
        f"held-out {info['held_out_loss'][0]:.3f} -> {info['held_out_loss'][-1]:.3f}, "
        f"{time.monotonic() - start:.1f} s"
    )
    print(
        f"accuracy over the 100 problems: sampled (T=1.0, {args.eval_samples}/problem) {info['sampled_accuracy']:.3f}, "
        f"greedy {info['greedy_accuracy']:.3f}, p(correct then EOS) {info['p_correct_then_eos']:.3f}"
    )
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
