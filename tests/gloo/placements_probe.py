"""Run under torchrun by test_trainer.py: export a model whose parameters mix every layout
`export_hf` handles (FSDP-style Shard(0), Replicate, Shard(1), plain tensors) and save the
full weights the export must contain.

Usage: torchrun --nproc-per-node 2 tests/gloo/placements_probe.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from transformers import AutoModelForCausalLM

from areal_cli.rundir.process import exit_without_teardown
from areal_cli.trainer import checkpoint


def main() -> None:
    model_dir, out = (Path(a) for a in sys.argv[1:3])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, (name, param) in enumerate(list(model.named_parameters())):
        layouts = [None, [Shard(0)], [Replicate()], [Shard(min(1, param.ndim - 1))]]
        if layouts[i % 4] is None:
            continue  # stays a plain tensor: rank 0 writes it whole
        owner, leaf = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(owner, leaf, nn.Parameter(distribute_tensor(param.data, mesh, layouts[i % 4])))
    checkpointer = checkpoint.Checkpointer()
    for step in range(2):  # the second export reuses the cached plan
        checkpointer.export_hf(out, f"v{step}", step, model, model_dir)
    if dist.get_rank() == 0:
        torch.save(expected, out / "expected.pt")
    dist.barrier()
    exit_without_teardown()  # gloo's teardown can abort a finished rank


if __name__ == "__main__":
    main()
