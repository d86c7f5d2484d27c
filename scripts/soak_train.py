"""Usage: python scripts/soak_train.py [--runs 20] [--steps 24] [--seed 0] [--timeout 600] [--keep]

Soak test of the CPU demo: runs `areal train recipes/tiny_cpu.yaml` --runs times, one
after the other, each with its own seed and a random actor.mb_spec.max_tokens_per_mb,
rollout.group_size and actor.ppo_n_minibatches (drawn from --seed, so a soak can be
repeated). Small token caps give the two ranks different numbers of micro-batches almost
every step, which is what used to deadlock them. Each run is classed as:
  finished  exit 0 and a metrics line for every step;
  hung      the run's watchdog reported it stuck, or it outlived --timeout (then this
            script kills its process group);
  failed    any other outcome.
It prints one line per run and a summary; the run directories of runs that did not
finish are kept under .soak/ (all of them with --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from areal_cli.launch.ports import free_port

REPO = Path(__file__).resolve().parents[1]
TOKEN_CAPS = (16, 20, 24, 32, 48, 64, 128, 512)
GROUP_SIZES = (2, 3, 4, 6, 8)


def one_run(index: int, rng: random.Random, args: argparse.Namespace, root: Path) -> dict:
    """Run the demo once with drawn settings; returns what happened."""
    settings = {
        "seed": rng.randrange(1, 10**6),
        "actor.mb_spec.max_tokens_per_mb": rng.choice(TOKEN_CAPS),
        "rollout.group_size": rng.choice(GROUP_SIZES),
        "actor.ppo_n_minibatches": rng.choice((1, 2)),
    }
    fileroot = root / f"run-{index:02d}"
    argv = [
        sys.executable, "-m", "areal_cli.cli", "train", "recipes/tiny_cpu.yaml",
        f"cluster.fileroot={fileroot}", f"total_train_steps={args.steps}",
        "logging.display=plain", "logging.tensorboard=false",
        f"launcher.inference_base_port={free_port()}", f"launcher.trainer_port={free_port()}",
        *(f"{k}={v}" for k, v in settings.items()),
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=args.timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    wall = time.monotonic() - start
    metrics = fileroot / "tiny-cpu" / "trial0" / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    if code == 0 and len(rows) == args.steps:
        outcome = "finished"
    elif code is None or "run stuck" in err:
        outcome = "hung"
    else:
        outcome = "failed"
    reason = ""
    if outcome != "finished":
        errors = [line for line in err.splitlines() if line.startswith("error")]
        reason = (errors or err.strip().splitlines() or ["(no output)"])[-1][:300]
        if code is None:
            reason = f"still running after {args.timeout:.0f} s; {reason}"
    elif not args.keep:
        shutil.rmtree(fileroot, ignore_errors=True)
    return {
        "outcome": outcome,
        "wall_s": wall,
        "steps": len(rows),
        "reward_last5": sum(r["reward_mean"] for r in rows[-5:]) / max(1, len(rows[-5:])),
        # steps where the ranks' own plans disagreed (the case that used to deadlock)
        "uneven_steps": sum(1 for r in rows if r.get("replanned_shards", 0) > 0),
        "reason": reason,
        "settings": settings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0, help="Seed of the drawn settings.")
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds per run.")
    parser.add_argument("--keep", action="store_true", help="Keep every run directory.")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = REPO / ".soak" / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True)
    counts = {"finished": 0, "hung": 0, "failed": 0}
    walls, uneven = [], 0
    for i in range(args.runs):
        r = one_run(i, rng, args, root)
        counts[r["outcome"]] += 1
        walls.append(r["wall_s"])
        uneven += r["uneven_steps"]
        s = r["settings"]
        print(
            f"run {i + 1:2d}/{args.runs}  {r['outcome']:8s}  {r['wall_s']:6.1f} s  "
            f"steps {r['steps']:2d} (uneven {r['uneven_steps']:2d})  "
            f"reward(last 5) {r['reward_last5']:.3f}  seed {s['seed']:6d}  "
            f"max_tokens_per_mb {s['actor.mb_spec.max_tokens_per_mb']:3d}  "
            f"group_size {s['rollout.group_size']}  minibatches {s['actor.ppo_n_minibatches']}"
            + (f"\n    {r['reason']}" if r["reason"] else ""),
            flush=True,
        )
    print(
        f"{args.runs} runs: {counts['finished']} finished, {counts['hung']} hung, "
        f"{counts['failed']} failed; wall per run {min(walls):.1f}-{max(walls):.1f} s "
        f"(median {sorted(walls)[len(walls) // 2]:.1f} s); {uneven} steps had ranks whose own "
        f"micro-batch plans differed in length"
    )
    if any(root.iterdir()):
        print(f"run directories kept in {root}")
    else:
        root.rmdir()
    sys.exit(0 if counts["finished"] == args.runs else 1)


if __name__ == "__main__":
    main()
