"""Usage: python scripts/bench_trainer.py [--preset tiny|small] [--steps 8] [--seqs 32] [--seq-len 96]
       python scripts/bench_trainer.py --layout d2,t2,c2 [--preset small] [--seqs 4] [--seq-len 1024]

With --layout: the trainer's step time and peak memory per rank (the largest peak RSS of
any rank, which includes the ~0.4 GB every Python+torch process starts with) for each
listed layout (fsdp:<layout>) against d1, in one run on the same model and batches. Each
rank gets one thread, so layouts with more ranks than this machine has cores also show
the cost of sharing them.

Without --layout:
Measures, in one run on the same model and batch:
  1. the 2-rank FSDP2 trainer step (real torchrun, gloo, 1 thread per rank) against a plain
     single-process loop (2 threads) running the same PPO math with no FSDP;
  2. the weight-publish time (every rank writes its rows into one safetensors file, fsync,
     manifest, rename; old versions are deleted in the background; median of the steps)
     against `dd if=/dev/zero of=... bs=4M conv=fdatasync` writing the same number of
     bytes, run once per step time like the publishes (and, for reference, back to back).
Prints both times and their ratios. Targets: publish <= 1.5x the disk limit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal_cli.config.schema import TrainEngineConfig  # noqa: E402
from areal_cli.launch.ports import free_port  # noqa: E402
from areal_cli.rundir.batch import RolloutBatch, write_batch  # noqa: E402


def make_batch(n_seqs: int, seq_len: int, vocab: int, group_size: int = 4) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(n_seqs):
        prompt = seq_len // 4
        n = seq_len + int(torch.randint(-seq_len // 4, seq_len // 4 + 1, (1,), generator=gen))
        mask = torch.cat([torch.zeros(prompt), torch.ones(n - prompt)]).to(torch.int8)
        seqs.append(
            {
                "input_ids": torch.randint(0, vocab, (n,), generator=gen),
                "loss_mask": mask,
                "logprobs": (-torch.rand(n, generator=gen) * 3 - 1) * mask,
                "versions": torch.where(mask.bool(), 0, -1).to(torch.int32),
            }
        )
    rewards = torch.randint(0, 2, (n_seqs,), generator=gen).float().tolist()
    return RolloutBatch.from_sequences(seqs, rewards, group_size)


def fsdp_steps(
    work: Path,
    model_dir: Path,
    batches: Path,
    steps: int,
    n_seqs: int,
    layout: str = "d2",
    actor: dict | None = None,
    trial: str | None = None,
) -> list[dict]:
    """Train `steps` fixed batches under real torchrun (fsdp:LAYOUT); the trainer's
    per-step records. `actor`: settings of the recipe's actor section; `trial`: the run's
    trial name (default: the layout), so that two runs of one layout keep apart."""
    from areal_cli.config.allocation import parse_allocation

    allocation = f"embedded:d1+fsdp:{layout}"
    train = parse_allocation(allocation).train
    nproc = train.world_size
    config = {
        "experiment_name": "bench",
        "trial_name": trial or layout,
        "allocation_mode": allocation,
        "total_train_steps": steps,
        "cluster": {"fileroot": str(work / "runs")},
        "model": {"path": str(model_dir)},
        "rollout": {"batch_size": max(1, n_seqs // 4), "group_size": min(4, n_seqs)},
        "recover": {"freq_steps": 0},
        "saver": {"freq_steps": steps},
        "actor": actor or {},
    }
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    argv = [
        torchrun,
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--log-dir",  # torchrun's per-attempt folders stay in the work folder, not /tmp
        str(work / "torchrun"),
        "-m",
        "areal_cli.trainer.main",
        "--config",
        str(work / "config.yaml"),
        "--batches",
        str(batches),
        *("--dp", str(train.data_parallel_size)),
        *("--cp", str(train.context_parallel_size)),
        *("--tp", str(train.tensor_parallel_size)),
    ]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    lines = (
        (work / "runs" / "bench" / (trial or layout) / "logs" / "trainer-metrics.jsonl")
        .read_text()
        .splitlines()
    )
    return [json.loads(line) for line in lines]


def plain_steps(model_dir: Path, batch: RolloutBatch, steps: int) -> list[float]:
    """The same math (train_step) in one process on an unsharded model."""
    from transformers import AutoModelForCausalLM

    from areal_cli.trainer.step import train_step

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(model, optimizer, None, batch, TrainEngineConfig(), 1.0)
        times.append(time.perf_counter() - start)
    return times


def dd_seconds(path: Path, n_bytes: int) -> float:
    blocks = max(1, round(n_bytes / (4 << 20)))
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={blocks}", "conv=fdatasync"],
        check=True,
        capture_output=True,
    )
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed * n_bytes / (blocks * (4 << 20))


def compare_layouts(args: argparse.Namespace) -> None:
    """Step time and peak memory per rank of each layout against d1 (see the docstring)."""
    from areal_cli.models.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="areal-bench-layouts-"))
    try:
        model_dir = build_tiny_model(work / "model", preset=args.preset, seed=0)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        batch = make_batch(args.seqs, args.seq_len, vocab, group_size=min(4, args.seqs))
        for step in range(args.steps):
            write_batch(work / "batches", step + 1, batch)  # steps count from 1
        rows = {}
        for layout in ["d1", *args.layout.split(",")]:
            records = fsdp_steps(work, model_dir, work / "batches", args.steps, args.seqs, layout)
            steady = records[1:] or records
            rows[layout] = (
                statistics.median(r["train_s"] for r in steady),
                max(r["state_mb"] for r in records),
                max(r["activation_bytes"] for r in records) / 2**20,
                max(r["peak_rss_mb"] for r in records),
            )
        print(
            f"model: preset {args.preset}; batch {args.seqs} seqs x ~{args.seq_len} tokens; "
            f"{args.steps} steps, median step time after the first. Per rank (largest of any "
            "rank): params + grads + optimizer state; bytes saved for backward by the largest "
            "micro-batch; peak RSS (with the ~0.4 GB of any torch process)"
        )
        print(
            f"{'layout':8s} {'step s':>14s} {'state MB':>15s} {'activations MB':>17s} {'peak RSS MB':>16s}"
        )
        base = rows["d1"]
        for layout, row in rows.items():
            cells = [f"{v:8.2f} {v / b:4.2f}x" for v, b in zip(row, base, strict=True)]
            print(f"{layout:8s} " + "   ".join(cells))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="FSDP2 step time and weight-publish time against baselines."
    )
    parser.add_argument("--preset", default="small", choices=("tiny", "small"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--layout", help="Compare these trainer layouts (comma-separated) with d1.")
    args = parser.parse_args()
    if args.layout:
        compare_layouts(args)
        return
    from areal_cli.models.tiny_model import build_tiny_model

    work = Path(
        tempfile.mkdtemp(
            prefix="areal-bench-trainer-",
            dir=REPO / ".bench" if (REPO / ".bench").is_dir() else None,
        )
    )
    try:
        model_dir = build_tiny_model(work / "model", preset=args.preset, seed=0)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        batch = make_batch(args.seqs, args.seq_len, vocab)
        for step in range(args.steps):
            write_batch(work / "batches", step + 1, batch)  # steps count from 1
        records = fsdp_steps(work, model_dir, work / "batches", args.steps, args.seqs)
        plain = plain_steps(model_dir, batch, args.steps)
        weight_bytes = (model_dir / "model.safetensors").stat().st_size
        fsdp_step = statistics.median(r["train_s"] for r in records[1:] or records)
        # dd back to back (median of 7), and dd paced like the publishes, one per trainer
        # step (median of 5). On a VM that hands idle memory back to its host, the first
        # write into it after a pause costs ~2 ms per MB more, and every publish comes
        # after a step's pause: the paced dd is the like-for-like limit.
        disk_hot = statistics.median(dd_seconds(work / "dd.bin", weight_bytes) for _ in range(7))
        disk = statistics.median(
            time.sleep(fsdp_step) or dd_seconds(work / "dd.bin", weight_bytes) for _ in range(5)
        )
        plain_step = statistics.median(plain[1:] or plain)
        # The virtual disk stalls now and then (~0.25 s): the median over 8 publishes.
        publish = statistics.median(r["publish_s"] for r in records)
        print(
            f"model: preset {args.preset}, {weight_bytes / 1e6:.1f} MB of fp32 weights; batch {args.seqs} seqs x ~{args.seq_len} tokens"
        )
        print(
            f"train step  2-rank FSDP2 (gloo): {fsdp_step:7.3f} s   plain 1-process loop: {plain_step:7.3f} s   ratio {fsdp_step / plain_step:5.2f}x"
        )
        print(
            f"publish     weights/vN:          {publish:7.3f} s   dd conv=fdatasync:    {disk:7.3f} s   ratio {publish / disk:5.2f}x (target <= 1.5x)"
        )
        print(
            f"            (dd paced one per step, like the publishes; back to back it takes {disk_hot:.3f} s: {publish / disk_hot:.2f}x)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
