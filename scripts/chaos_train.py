"""Usage: python scripts/chaos_train.py [--faults 20 | --each 10] [--steps 60] [--seed 0]
           [--layout split|distributed|colocated] [--keep] [--set KEY=VALUE ...]

Chaos benchmark of fault recovery: runs `areal train recipes/tiny_cpu.yaml` and kills,
--faults times at random moments, one of
  server      the inference server (kill -9): the run restarts it;
  trainer     one trainer rank, at random (kill -9): the run relaunches the trainer from
              its newest recover checkpoint;
  controller  the `areal train` process itself (kill -9; its children die with it):
              this script then runs `areal train ... --resume`, as a user would.
Each fault waits until the run finished a step since the previous one, then a random
0-3 s more (drawn from --seed, so a chaos run can be repeated). When the faults are
done the run goes on to --steps, and the script checks:
  lost, duplicated  steps missing from, or repeated in, RUN/metrics.jsonl;
  orphans           processes of the run still alive after it ended;
  partial entries   unfinished writes left in the run directory (`.tmp-*`, `.trash-*`,
                    `*.tmp`) and handoff entries without a readable manifest;
  final weights     whether the last checkpoint loads with transformers.
--each N kills N of every kind instead (in an order drawn from --seed). --layout picks
one of the tested layouts of the demo:
  split        embedded:d1+fsdp:d1, weights on disk (the recipe's own);
  distributed  the same, weights over the network (actor.weight_update.method);
  colocated    embedded:d1|fsdp:d1: server and trainer take turns on the same cores
               (rollout.max_staleness 0), so a fault can land inside either turn.
--set adds more recipe overrides. It prints one line per fault and a summary, and exits
1 unless every count is 0 and the weights load. The run directory is under .chaos/
(removed on success unless --keep).
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
from collections import Counter
from pathlib import Path

from areal_cli.launch.ports import free_port

REPO = Path(__file__).resolve().parents[1]
KINDS = ("server", "trainer", "controller")
LAYOUTS = {
    "split": [],
    "distributed": ["actor.weight_update.method=distributed"],
    "colocated": ["allocation_mode=embedded:d1|fsdp:d1", "rollout.max_staleness=0"],
}


def processes_of(run_dir: Path) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose command line names the run directory."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmd:
            found.append((int(entry.name), cmd))
    return found


def steps_done(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def victim(kind: str, run_dir: Path, rng: random.Random) -> int | None:
    """The pid to kill for a fault of `kind` (None when there is none right now)."""
    if kind == "server":
        pids = [p for p, cmd in processes_of(run_dir) if "areal_cli.inference.server" in cmd]
        return pids[0] if pids else None
    beats = sorted((run_dir / "heartbeat").glob("trainer-*.json"))
    if not beats:
        return None
    try:
        pid = json.loads(rng.choice(beats).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


def partial_entries(run_dir: Path) -> list[str]:
    """Unfinished writes and handoff entries that a reader could not take."""
    from areal_cli.rundir import handoff

    bad = [
        str(p.relative_to(run_dir))
        for p in run_dir.rglob("*")
        if p.name.startswith((".tmp-", ".trash-")) or p.name.endswith(".tmp")
    ]
    for parent, prefix in (("weights", "v"), ("rollouts", "step-"), ("recover", "step-")):
        for entry in handoff.list_entries(run_dir / parent, prefix):
            try:
                handoff.read_entry(entry.path)
            except Exception as exc:  # any unreadable entry counts
                bad.append(f"{parent}/{entry.path.name} ({exc.__class__.__name__})")
    return bad


def weights_load(run_dir: Path, step: int) -> bool:
    from transformers import AutoModelForCausalLM

    try:
        AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / f"step-{step}")
    except Exception as exc:
        print(f"final weights do not load: {exc}")
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--each", type=int, help="N faults of every kind (in place of --faults)")
    parser.add_argument("--layout", choices=list(LAYOUTS), default="split")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="for the whole run")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    order = None  # --each: the kinds to kill, in order
    if args.each is not None:
        order = [kind for kind in KINDS for _ in range(args.each)]
        rng.shuffle(order)
        args.faults = len(order)
    root = REPO / ".chaos" / f"seed{args.seed}"
    shutil.rmtree(root, ignore_errors=True)
    run_dir = root / "tiny-cpu" / "trial0"
    argv = [
        sys.executable, "-m", "areal_cli.cli", "train", "recipes/tiny_cpu.yaml",
        f"cluster.fileroot={root}", f"total_train_steps={args.steps}",
        "logging.display=plain", "logging.tensorboard=false", "recover.freq_steps=1",
        f"launcher.inference_base_port={free_port()}", f"launcher.trainer_port={free_port()}",
        f"launcher.restarts.trainer={args.faults}", f"launcher.restarts.server={args.faults}",
        *LAYOUTS[args.layout], *args.set,
    ]  # fmt: skip
    root.mkdir(parents=True)
    log = open(root.parent / f"seed{args.seed}.log", "w")  # noqa: SIM115 - the whole run
    start = time.monotonic()

    def launch(resume: bool) -> subprocess.Popen:
        return subprocess.Popen(
            argv + (["--resume"] if resume else []), cwd=REPO, stdout=log, stderr=log
        )

    proc = launch(resume=False)
    done: Counter[str] = Counter()
    resumes = 0
    while sum(done.values()) < args.faults and time.monotonic() - start < args.timeout:
        before = len(steps_done(run_dir))
        while len(steps_done(run_dir)) <= before and proc.poll() is None:
            time.sleep(0.2)  # a step since the last fault: the run recovered
        if proc.poll() is not None:
            if proc.returncode == 0:
                print(f"the run finished after {sum(done.values())} faults; raise --steps")
                break
            print(f"the run failed (exit {proc.returncode}); see {root.parent}/seed{args.seed}.log")
            return 1
        time.sleep(rng.uniform(0.0, 3.0))
        kind = order[sum(done.values())] if order is not None else rng.choice(KINDS)
        t = time.monotonic() - start
        if kind == "controller":
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            deadline = time.monotonic() + 30
            while processes_of(run_dir) and time.monotonic() < deadline:
                time.sleep(0.2)  # its children die with it (parent-death signal)
            proc = launch(resume=True)
            resumes += 1
        else:
            pid = victim(kind, run_dir, rng)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        done[kind] += 1
        print(f"fault {sum(done.values()):2d} at {t:6.1f}s: killed the {kind}", flush=True)
    try:
        proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        proc.kill()
        print("the run outlived --timeout")
    elapsed = time.monotonic() - start
    time.sleep(1.0)
    steps = steps_done(run_dir)
    counts = Counter(steps)
    lost = [s for s in range(1, args.steps + 1) if s not in counts]
    duplicated = [s for s, n in counts.items() if n > 1]
    orphans = processes_of(run_dir)
    partial = partial_entries(run_dir)
    loads = weights_load(run_dir, args.steps)
    print(
        f"faults {sum(done.values())} ({', '.join(f'{k} {done[k]}' for k in KINDS)}), "
        f"resumes {resumes}, exit {proc.returncode}, {elapsed:.0f}s for {args.steps} steps"
    )
    print(
        f"lost steps {len(lost)} {lost[:10]}  duplicated steps {len(duplicated)} "
        f"{duplicated[:10]}  orphans {len(orphans)}  partial entries {len(partial)} "
        f"{partial[:5]}  final weights load: {'yes' if loads else 'no'}"
    )
    for pid, cmd in orphans:
        print(f"orphan {pid}: {cmd[:300]}")
        os.kill(pid, signal.SIGKILL)
    ok = proc.returncode == 0 and not (lost or duplicated or orphans or partial) and loads
    if ok and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
