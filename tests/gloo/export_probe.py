"""Run under torchrun by test_trainer.py: train one step with 2 FSDP2 ranks, record the
logits of the sharded model on a fixed input, export weights, and save both for the test.

Usage: torchrun --nproc-per-node 2 tests/gloo/export_probe.py CONFIG BATCHES OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from areal_cli.config.loader import load_config
from areal_cli.rundir import handoff
from areal_cli.rundir.batch import read_batch
from areal_cli.trainer import checkpoint
from areal_cli.trainer.main import build_optimizer
from areal_cli.trainer.parallelize import build_sharded_model
from areal_cli.trainer.step import train_step


def main() -> None:
    config, batches, out = (Path(a) for a in sys.argv[1:4])
    cfg = load_config(config).config
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model_dir = Path(cfg.model.path)
    model = build_sharded_model(model_dir, mesh, cfg.actor.fsdp)
    optimizer, scheduler = build_optimizer(model, cfg)
    batch = read_batch(handoff.read_entry(batches / "step-0"))
    train_step(model, optimizer, scheduler, batch, cfg.actor, 1.0)
    probe = torch.arange(20).remainder(90).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=probe, use_cache=False).logits
    checkpoint.export_hf(out, "v1", 1, model, model_dir)
    if dist.get_rank() == 0:
        torch.save({"probe": probe, "logits": logits}, out / "trainer_logits.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
