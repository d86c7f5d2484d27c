"""Usage: python scripts/bench_async.py [--steps 30] [--batch-size 1] [--group-size 4] [--max-new-tokens 64]

Runs the tiny CPU recipe twice in one invocation, with rollout.max_staleness=0
(synchronous RL) and =2 (asynchronous), for the same number of steps, and prints:
  - steps/s of each (steady state: from the first to the last step's metrics line) and
    their ratio;
  - G and T: seconds per step spent generating (the trainer's wait for data in the sync
    run, where nothing overlaps) and training (step + publish), and the physical cap
    (G+T)/max(G,T) on the ratio;
  - the weight handoff (trainer starts writing weights/vN -> every server serves vN)
    against the raw disk time of the same bytes, for the async run (the server is busy
    generating when weights land; the target) and for the sync run (the server is idle).
    Raw disk time: this process writes the published file's bytes to a new file,
    fdatasyncs it and reads it back, back to back (both cores are busy in the async run,
    so no idle-wake cost is in either figure). It is measured in-process on purpose:
    timing `dd conv=fdatasync` would add ~1.5-2 ms of process start at 4 MB, a third of
    the total, and flatter the ratio.
The server and the trainer get one core each (cluster.n_cpus=2, allocation
embedded:d1+fsdp:d1), the CPU counterpart of disjoint GPUs. The default batch shape
(1 prompt x 4 samples, 64 new tokens) is chosen so that G and T are comparable (both
~0.08 s per step on the CI machine): generating is cheap per token next to training on
this tiny model, so a small batch with long answers balances the two.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from areal_cli.launch.ports import free_port

REPO = Path(__file__).resolve().parents[1]


def run(fileroot: Path, staleness: int, args: argparse.Namespace) -> list[dict]:
    argv = [
        sys.executable,
        "-m",
        "areal_cli.cli",
        "train",
        "recipes/tiny_cpu.yaml",
        f"cluster.fileroot={fileroot}",
        f"trial_name=stale{staleness}",
        "logging.display=plain",
        "logging.tensorboard=false",
        "allocation_mode=embedded:d1+fsdp:d1",
        "cluster.n_cpus=2",
        f"total_train_steps={args.steps}",
        f"rollout.max_staleness={staleness}",
        f"rollout.batch_size={args.batch_size}",
        f"rollout.group_size={args.group_size}",
        "rollout.max_concurrent_rollouts=null",
        f"gconfig.max_new_tokens={args.max_new_tokens}",
        "gconfig.ignore_eos=true",
        "recover.freq_steps=0",
        f"launcher.inference_base_port={free_port()}",
        f"launcher.trainer_port={free_port()}",
    ]
    if args.model:
        argv.append(f"model.path={args.model}")
    subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    path = fileroot / "tiny-cpu" / f"stale{staleness}" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_per_s(rows: list[dict], skip: int) -> float:
    rows = rows[skip:]
    return (len(rows) - 1) / (rows[-1]["time"] - rows[0]["time"])


def disk_seconds(path: Path, data: bytes) -> float:
    """Write `data` to a new file, fdatasync, read it back: the raw disk cost of a handoff."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.write(fd, view[done:])
        os.fdatasync(fd)
    finally:
        os.close(fd)
    with open(path, "rb", buffering=0) as f:
        f.readinto(bytearray(len(data)))
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Synchronous vs asynchronous steps/s on the tiny recipe."
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=2, help="Warm-up steps left out of the rate.")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default="", help="Model folder (default: the recipe's).")
    parser.add_argument("--keep", action="store_true", help="Keep the run directories.")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="areal-bench-async-"))
    try:
        sync = run(work, 0, args)
        asyn = run(work, 2, args)
        version = next((work / "tiny-cpu" / "stale2" / "weights").glob("v*"))
        data = b"".join(f.read_bytes() for f in sorted(version.glob("*.safetensors")))
        n_bytes = len(data)
        # The virtual disk's fdatasync time varies from one write to the next: median of 11.
        disk = statistics.median(disk_seconds(work / "raw.bin", data) for _ in range(11))
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    rate_sync, rate_async = steps_per_s(sync, args.skip), steps_per_s(asyn, args.skip)
    steady = sync[args.skip :]
    train = statistics.median(r["trainer_step_s"] + r["handoff_save_s"] for r in steady)
    # In sync mode the trainer waits while the batch is generated (and the weights load).
    gen = statistics.median(r["trainer_wait_s"] for r in steady)
    # The async run's handoff is the one that counts: it lands while the server generates.
    handoff = statistics.median(r["handoff_total_s"] for r in asyn[args.skip :])
    handoff_idle = statistics.median(r["handoff_total_s"] for r in steady)
    print(
        f"batch: {args.batch_size} prompts x {args.group_size} samples, {args.max_new_tokens} new tokens; {args.steps} steps"
    )
    print(f"sync  (max_staleness=0): {rate_sync:6.3f} steps/s")
    print(f"async (max_staleness=2): {rate_async:6.3f} steps/s")
    print(f"ratio async/sync:        {rate_async / rate_sync:6.2f}x   (target >= 1.6)")
    print(
        f"per step: G (generate) {gen:.2f}s  T (train + publish) {train:.2f}s  cap (G+T)/max(G,T) = {(gen + train) / max(gen, train):.2f}"
    )
    print(
        f"handoff: {handoff * 1000:.1f} ms (publish start -> all servers on vN, async run) vs raw disk {disk * 1000:.1f} ms for {n_bytes / 1e6:.1f} MB: {handoff / disk:.2f}x (target <= 2)"
    )
    print(
        f"         {handoff_idle * 1000:.1f} ms in the sync run, where the server is idle when weights land: {handoff_idle / disk:.2f}x"
    )
    # Where the async run's handoff goes (medians, so the parts need not add up exactly).
    rows = asyn[args.skip :]
    write = statistics.median(r["handoff_total_s"] - r["handoff_latency_s"] for r in rows)
    commit = statistics.median(r["handoff_latency_s"] - r["handoff_load_s"] for r in rows)
    load = statistics.median(r["handoff_load_s"] for r in rows)
    print(
        f"         async parts: trainer writes + syncs the data {write * 1000:.1f} ms, manifest + rename + controller wakes {commit * 1000:.1f} ms, update call to all servers {load * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
