"""Usage: torchrun ... logprob_probe.py CONFIG BATCHES OUT

Per-position logprobs and entropies of every sequence of BATCHES/step-1 (in label space:
position p scores the token after it) under the model sharded as CONFIG's allocation says
(tensor-parallel logits stay split over the vocabulary, context-parallel ranks score a
slice each); rank 0 saves them to OUT/logprobs.pt for a comparison across layouts."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from areal_cli.config.allocation import parse_allocation
from areal_cli.config.loader import load_config
from areal_cli.rundir import handoff
from areal_cli.rundir.batch import read_batch
from areal_cli.rundir.process import exit_without_teardown
from areal_cli.trainer.mesh import build_mesh, step_layout
from areal_cli.trainer.parallelize import build_sharded_model
from areal_cli.trainer.step import forward_logprobs


def _gather(x: torch.Tensor, group, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def main() -> None:
    config, batches, out = (Path(a) for a in sys.argv[1:4])
    cfg = load_config(config).config
    dist.init_process_group("gloo")
    mesh = build_mesh("cpu", parse_allocation(cfg.allocation_mode).train)
    model = build_sharded_model(Path(cfg.model.path), mesh, cfg.actor.fsdp)
    layout = step_layout(mesh, model.get_output_embeddings().weight.shape[0])
    batch = read_batch(handoff.read_entry(batches / "step-1"))
    with torch.no_grad():
        logp, entropy, _ = forward_logprobs(model, batch, list(range(batch.n_seqs)), 0.7, layout)
    if mesh.cp > 1:  # each cp rank scored a slice of the positions: put them together
        total = int(batch.seqlens.sum())
        logp, entropy = (_gather(x, layout.cp_group, mesh.cp)[:total] for x in (logp, entropy))
    blocks = {}  # where each rank's block of two sample weights lies, as --dry-run says
    for name in ("q_proj", "o_proj"):
        weight = getattr(model.model.layers[0].self_attn, name).weight
        if hasattr(weight, "device_mesh"):
            shape, offset = compute_local_shape_and_global_offset(
                weight.shape, weight.device_mesh, weight.placements
            )
        else:  # a 1-rank trainer holds plain tensors (parallelize.single_rank)
            shape, offset = weight.shape, [0] * weight.dim()
        blocks[name] = (tuple(offset), tuple(shape))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, blocks)
    if dist.get_rank() == 0:
        torch.save({"logp": logp, "entropy": entropy, "blocks": every}, out / "logprobs.pt")
    dist.barrier()
    exit_without_teardown()  # gloo's teardown can abort a finished rank


if __name__ == "__main__":
    main()
