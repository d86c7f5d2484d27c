"""Usage: python scripts/bench_lora.py [--model DIR] [--rank 16] [--steps 4] [--seqs 16] [--seq-len 256]

LoRA against full fine-tuning, in one run on the same model and fixed batches (a
1-rank trainer under real torchrun, one thread; SmolLM2-135M from `make smollm2` by
default, rank 16 on all-linear):
  - trainable parameters, and the optimizer state they need (AdamW: two float32 moments);
  - the trainer's parameters + gradients + optimizer state (its own `state_mb` record);
  - bytes per weight update: the published RUN/weights/vK entry (an adapter folder
    against a whole HF export), and the time to publish it;
  - seconds per step (median after the first).
Prints each figure for both and the ratio LoRA / full. Name the CPU (lscpu) beside them.
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

from areal_cli.models.builtin import cache_dir  # noqa: E402
from scripts.bench_trainer import fsdp_steps, make_batch  # noqa: E402

SMOLLM2 = cache_dir() / "models" / "smollm2-135m-instruct"  # make smollm2


def counts(model_dir: Path, rank: int) -> tuple[int, int]:
    """(all parameters, adapter parameters) of the model with rank-`rank` all-linear LoRA."""
    import torch

    from areal_cli.models import lora
    from areal_cli.models.decoder import DecoderConfig, DecoderLM

    model = DecoderLM.on_meta(DecoderConfig.from_folder(model_dir), torch.float32)
    full = sum(p.numel() for p in model.parameters())
    lora.inject(model, lora.LoraSpec(rank, 2.0 * rank, ("all-linear",)))
    return full, sum(p.numel() for p in model.parameters() if p.requires_grad)


def published_bytes(run: Path) -> int:
    """Bytes of the newest RUN/weights/vK entry (its manifest's files)."""
    from areal_cli.rundir import handoff

    entry = handoff.latest(run / "weights", "v")
    return sum(f["size"] for f in handoff.read_entry(entry.path).manifest["files"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        sys.exit(f"error: no model at {args.model}; run make smollm2, or pass --model DIR")
    from areal_cli.rundir.batch import write_batch

    work = Path(tempfile.mkdtemp(prefix="areal-bench-lora-"))
    try:
        vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
        batch = make_batch(args.seqs, args.seq_len, vocab)
        for step in range(args.steps):
            write_batch(work / "batches", step + 1, batch)
        common = {"optimizer": {"lr": 1e-5}, "mb_spec": {"max_tokens_per_mb": 8192}}
        lora = {"use_lora": True, "lora_rank": args.rank, "lora_alpha": 2 * args.rank}
        runs = {
            "full": fsdp_steps(work, args.model, work / "batches", args.steps, args.seqs,
                               "d1", common, "full"),
            "lora": fsdp_steps(work, args.model, work / "batches", args.steps, args.seqs,
                               "d1", {**common, **lora}, "lora"),
        }  # fmt: skip
        total, adapters = counts(args.model, args.rank)
        trained = {"full": total, "lora": adapters}
        rows = []
        for name, records in runs.items():
            steady = records[1:] or records
            rows.append(
                (
                    name,
                    trained[name],
                    trained[name] * 8,  # AdamW: exp_avg and exp_avg_sq in float32
                    max(r["state_mb"] for r in records) * 2**20,
                    published_bytes(work / "runs" / "bench" / name),
                    statistics.median(r["publish_s"] for r in steady),
                    statistics.median(r["train_s"] for r in steady),
                )
            )
        print(
            f"model {args.model.name} ({total / 1e6:.1f}M parameters); LoRA rank {args.rank}, "
            f"all-linear; {args.steps} steps of {args.seqs} x ~{args.seq_len} tokens; 1 rank, 1 thread"
        )
        heads = [
            "trainable",
            "optimizer B",
            "params+grads+opt B",
            "update B",
            "publish s",
            "s/step",
        ]
        print(f"{'':6s}" + "".join(f"{h:>20s}" for h in heads))
        for name, *values in rows:
            print(f"{name:6s}" + "".join(f"{v:>20,.3f}" if isinstance(v, float) else f"{v:>20,d}"
                                         for v in values))  # fmt: skip
        full, lora_row = rows[0][1:], rows[1][1:]
        print(
            f"{'ratio':6s}"
            + "".join(f"{b / a:>19.4f}x" for a, b in zip(full, lora_row, strict=True))
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
