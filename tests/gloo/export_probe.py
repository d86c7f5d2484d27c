"""Run under torchrun by test_trainer.py: train one step with 2 FSDP2 ranks, record the
logits of the sharded model on a fixed input, export weights, and save both for the test.

Usage: torchrun --nproc-per-node 2 tests/gloo/export_probe.py CONFIG BATCHES OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from areal_cli.config.allocation import parse_allocation
from areal_cli.config.loader import load_config
from areal_cli.rundir import handoff
from areal_cli.rundir.batch import read_batch
from areal_cli.rundir.process import exit_without_teardown
from areal_cli.trainer import checkpoint
from areal_cli.trainer.mesh import build_mesh, step_layout
from areal_cli.trainer.parallelize import build_sharded_model
from areal_cli.trainer.state import build_optimizer
from areal_cli.trainer.step import train_step


def main() -> None:
    config, batches, out = (Path(a) for a in sys.argv[1:4])
    cfg = load_config(config).config
    dist.init_process_group("gloo")
    mesh = build_mesh("cpu", parse_allocation(cfg.allocation_mode).train)
    model_dir = Path(cfg.model.path)
    model = build_sharded_model(model_dir, mesh, cfg.actor.fsdp)
    optimizer, scheduler = build_optimizer(model, cfg)
    batch = read_batch(handoff.read_entry(batches / "step-1"))
    layout = step_layout(mesh, model.get_output_embeddings().weight.shape[0])
    train_step(model, optimizer, scheduler, batch, cfg.actor, 1.0, layout=layout)
    probe = torch.arange(20).remainder(90).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=probe, use_cache=False).logits
    if mesh.tp > 1:  # the logits are split over the vocabulary: put them together
        parts = [torch.empty_like(logits) for _ in range(mesh.tp)]
        dist.all_gather(parts, logits.contiguous(), group=mesh.tp_group())
        logits = torch.cat(parts, dim=-1)
    checkpoint.Checkpointer().export_hf(out, "v1", 1, model, model_dir)
    if dist.get_rank() == 0:
        torch.save({"probe": probe, "logits": logits}, out / "trainer_logits.pt")
    dist.barrier()
    exit_without_teardown()  # gloo's teardown can abort a finished rank


if __name__ == "__main__":
    main()
