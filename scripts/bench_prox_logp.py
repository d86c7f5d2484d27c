"""Usage: python scripts/bench_prox_logp.py [--preset small] [--steps 6] [--seqs 32] [--seq-len 96] [--minibatches 4]

actor.prox_logp_method: the step time that the loglinear approximation saves against
recomputing the proximal logprobs, in one run on the same model and fixed stale batches
(a 1-rank trainer under real torchrun, one thread; the builtin `small` preset by
default). The proximal pass only runs where it is needed: ppo_n_minibatches > 1 and
tokens from an older version (every fixed batch but the first); minibatch 0 never needs
it. Prints the median seconds per step (steps 2..N) of recompute, loglinear and metrics
(recompute plus the approximations' errors, which it prints too), the ratio
loglinear / recompute and the seconds saved. Name the CPU (lscpu) beside them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.bench_trainer import fsdp_steps, make_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=("tiny", "small"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--minibatches", type=int, default=4)
    args = parser.parse_args()
    from areal_cli.models.tiny_model import build_tiny_model
    from areal_cli.rundir.batch import write_batch

    work = Path(tempfile.mkdtemp(prefix="areal-bench-prox-"))
    try:
        model_dir = build_tiny_model(work / "model", preset=args.preset, seed=0)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        batch = make_batch(args.seqs, args.seq_len, vocab)  # tokens of version 0
        for step in range(args.steps):
            write_batch(work / "batches", step + 1, batch)
        seconds, records = {}, {}
        for method in ("recompute", "loglinear", "metrics"):
            actor = {"ppo_n_minibatches": args.minibatches, "prox_logp_method": method}
            rows = fsdp_steps(
                work, model_dir, work / "batches", args.steps, args.seqs, "d1", actor, method
            )
            records[method] = rows
            seconds[method] = statistics.median(r["train_s"] for r in rows[1:])
        base, fast = seconds["recompute"], seconds["loglinear"]
        print(
            f"model: preset {args.preset}; batch {args.seqs} seqs x ~{args.seq_len} tokens, "
            f"ppo_n_minibatches {args.minibatches}; median of steps 2..{args.steps}"
        )
        for method, s in seconds.items():
            print(f"  {method:9s} {s:7.3f} s/step   ratio to recompute {s / base:5.2f}x")
        print(f"loglinear saves {base - fast:.3f} s/step ({(base - fast) / base:.0%})")
        errors = {k: v for k, v in records["metrics"][-1].items() if k.startswith("prox_")}
        print(
            "approximation error, mean |log p| over the recomputed tokens (last step; the fixed "
            "batches' behaviour logprobs are random, so only the order means something here, "
            "see a real run's metrics for sizes):"
        )
        for key, value in sorted(errors.items()):
            print(f"  {key}: {value:.4f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
