"""Usage: python scripts/measure_colocated_memory.py [--recipe recipes/smollm2_math_cpu.yaml]
       [--steps 3] [--set KEY=VALUE ...] [--interval 0.1]
  e.g. make smollm2; python scripts/measure_colocated_memory.py

Runs RECIPE colocated (allocation embedded:d1|fsdp:d1, max_staleness 0) and follows the
server process's resident memory (/proc/PID/status) against the trainer's heartbeat:
while the trainer has given the devices back (`holds_devices` false) it is the server's
turn; while the trainer holds them in a step ("step K: ...") the server has released
its memory. It also asks the server's /server_info for its KV cache in its turn.
Prints, in MiB:
  - the server's resident size while generating (its largest, before the first step),
    while the trainer steps (median and largest), and generating again after it, and
    the fall between the first two;
  - the server's weights (parameters x its dtype) and its KV cache at its largest: the
    fall should be at least their sum.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def server_info(run_dir: Path) -> dict:
    from areal_cli.config.loader import load_config

    cfg = load_config(run_dir / "config.yaml").config
    plan = json.loads((run_dir / "plan.json").read_text())
    port = plan["processes"][0]["ports"][0]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/server_info")
    if cfg.inference.api_key:
        request.add_header("Authorization", f"Bearer {cfg.inference.api_key}")
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.loads(answer.read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2_math_cpu.yaml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--interval", type=float, default=0.1)
    args = parser.parse_args()
    from areal_cli.config.loader import load_config
    from areal_cli.config.model_info import model_config
    from areal_cli.config.phase_memory import DTYPE_BYTES, param_count

    colocate = ["allocation_mode=embedded:d1|fsdp:d1", "rollout.max_staleness=0"]
    cfg = load_config(args.recipe, [*colocate, *args.overrides]).config
    colocate.append(f"rollout.max_concurrent_rollouts={cfg.rollout.batch_size}")
    weights_mb = (
        param_count(model_config(cfg.model.path))
        * DTYPE_BYTES[cfg.inference.embedded.dtype]
        / 2**20
    )
    generating: list[float] = []
    stepping: list[float] = []
    back: list[float] = []  # generating again, after a step
    kv_mb = 0.0
    with tempfile.TemporaryDirectory(prefix="colocated-memory-") as root:
        argv = [sys.executable, "-m", "areal_cli.cli", "train", str(args.recipe), *colocate]
        argv += [*args.overrides, f"total_train_steps={args.steps}", f"cluster.fileroot={root}"]
        argv += ["logging.display=plain"]
        run = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        run_dir = Path(root) / cfg.experiment_name / cfg.trial_name
        while run.poll() is None:
            time.sleep(args.interval)
            try:
                children = json.loads((run_dir / "run.json").read_text())["children"]
                beat = json.loads((run_dir / "heartbeat" / "trainer-0.json").read_text())
            except (OSError, ValueError, KeyError):
                continue
            rss = rss_mb(children.get("server-0", 0))
            if rss is None:
                continue
            if not beat.get("holds_devices", True):  # the server's turn
                (back if stepping else generating).append(rss)
                try:
                    kv_mb = max(kv_mb, server_info(run_dir)["kv_cache_mb"])
                except OSError:
                    pass
            elif beat["phase"].startswith("step "):  # the trainer's turn, in a step
                stepping.append(rss)
        output = run.stdout.read() if run.stdout else ""
        if run.returncode != 0:
            print(output[-3000:])
            return 1
    if not generating or not stepping or not back:
        print(f"too few samples: {len(generating)} generating, {len(stepping)} stepping")
        return 1
    top, median, high = max(generating), statistics.median(stepping), max(stepping)
    print(f"{args.recipe.name} colocated, {args.steps} steps, samples every {args.interval}s")
    print(
        f"server resident: generating {top:.0f} MiB (largest of {len(generating)} samples); "
        f"while the trainer steps median {median:.0f} MiB, largest {high:.0f} "
        f"({len(stepping)} samples)"
    )
    print(
        f"back after the step: the server's turn again {max(back):.0f} MiB (largest of {len(back)})"
    )
    print(
        f"fall {top - median:.0f} MiB from the first turn, {max(back) - median:.0f} MiB from "
        f"the later ones (they keep the buffer a load reads into); weights {weights_mb:.0f} MiB "
        f"({cfg.inference.embedded.dtype}) + KV cache at its largest {kv_mb:.0f} MiB = "
        f"{weights_mb + kv_mb:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
