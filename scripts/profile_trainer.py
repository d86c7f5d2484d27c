"""Usage: python scripts/profile_trainer.py [--preset tiny|small] [--seqs 128] [--seq-len 20]
       [--steps 4] [--threads 1] [--max-tokens-per-mb 2048] [--top 15] [--on-policy]

Where a 1-rank trainer step spends its time: torch.profiler over `train_step` on the
trainer's own model build (`build_sharded_model` on a 1-rank gloo group, as `fsdp:d1`
gets it), next to the same step on the plain unwrapped HF model. Prints, for each, the
median step time after a warm-up step and the top operators by self CPU time. The
defaults are the demo's shape: 16 x 8 sequences of about 20 tokens, one thread (the
trainer's share of this machine's 2 cores in the demo's layout).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_trainer import free_port, make_batch  # noqa: E402


def _steps(model, batch, cfg, n: int, layout, version: int | None) -> tuple[list[float], object]:
    from torch.profiler import ProfilerActivity, profile

    from areal_cli.trainer.step import train_step

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            start = time.perf_counter()
            train_step(
                model, optimizer, None, batch, cfg, 1.0, layout=layout, policy_version=version
            )
            times.append(time.perf_counter() - start)
    return times, prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens-per-mb", type=int, default=2048)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--on-policy", action="store_true", help="Mark the batch on-policy (no proximal pass)."
    )
    args = parser.parse_args()
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from areal_cli.config.schema import FSDPEngineConfig, ParallelStrategy, TrainEngineConfig
    from areal_cli.models.tiny_model import build_tiny_model
    from areal_cli.trainer import attention
    from areal_cli.trainer.mesh import build_mesh, step_layout
    from areal_cli.trainer.parallelize import build_sharded_model

    torch.set_num_threads(args.threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"
    )
    dist.init_process_group("gloo")
    work = Path(tempfile.mkdtemp(prefix="areal-profile-"))
    try:
        model_dir = build_tiny_model(work / "model", preset=args.preset, seed=0)
        vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
        batch = make_batch(args.seqs, args.seq_len, vocab, group_size=8)
        version = 0 if args.on_policy else 1  # make_batch's tokens are version 0
        cfg = TrainEngineConfig()
        cfg.mb_spec.max_tokens_per_mb = args.max_tokens_per_mb
        tmesh = build_mesh("cpu", ParallelStrategy())
        sharded = build_sharded_model(model_dir, tmesh, FSDPEngineConfig())
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        plain.config.use_cache = False
        attention.register(1)
        plain.config._attn_implementation = attention.ATTENTION
        layout = step_layout(tmesh, vocab)
        print(
            f"preset {args.preset}; {args.seqs} seqs x ~{args.seq_len} tokens; "
            f"max_tokens_per_mb {args.max_tokens_per_mb}; {args.threads} thread(s); "
            f"{'on' if args.on_policy else 'off'}-policy; median of {args.steps - 1} steps after one"
        )
        for name, model in (("fsdp:d1 (build_sharded_model)", sharded), ("plain HF model", plain)):
            times, prof = _steps(model, batch, cfg, args.steps, layout, version)
            print(f"\n== {name}: {statistics.median(times[1:]):.3f} s/step")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
            print(table)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
