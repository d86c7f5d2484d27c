"""Run under torchrun by test_weights_over_gloo.py: move a sharded model one optimizer step
away from its start, send it as v1 over the weight-update group, and export the same
weights as an HF folder for the test to compare.

Usage: torchrun --nproc-per-node N tests/gloo/weight_group_probe.py MODEL WEIGHTS OUT
       GROUP_JSON DP TP
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from areal_cli.config.schema import FSDPEngineConfig, ParallelStrategy
from areal_cli.rundir.process import exit_without_teardown
from areal_cli.rundir.weight_group import GroupSpec
from areal_cli.trainer import checkpoint
from areal_cli.trainer.mesh import build_mesh
from areal_cli.trainer.parallelize import build_sharded_model
from areal_cli.trainer.weight_sender import WeightSender


def main() -> None:
    model_dir, weights, out = (Path(a) for a in sys.argv[1:4])
    spec = GroupSpec.from_json(json.loads(sys.argv[4]))
    dp, tp = int(sys.argv[5]), int(sys.argv[6])
    dist.init_process_group("gloo")
    strategy = ParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    mesh = build_mesh("cpu", strategy)
    model = build_sharded_model(model_dir, mesh, FSDPEngineConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    probe = torch.arange(24).remainder(90).unsqueeze(0)
    model(input_ids=probe, use_cache=False).logits.float().pow(2).mean().backward()
    optimizer.step()  # every tensor now differs from the folder the servers started from
    sender = WeightSender(spec, weights, bucket_bytes=256 * 1024)  # several buckets
    sender.join()
    sender.publish(1, model, {"step": 1}, keep_last=2)
    checkpoint.Checkpointer().export_hf(out, "v1", 1, model, model_dir)
    dist.barrier()
    exit_without_teardown()  # gloo's teardown can abort a finished rank


if __name__ == "__main__":
    main()
