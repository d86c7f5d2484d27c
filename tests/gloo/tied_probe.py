"""Run under torchrun by test_trainer.py: a model with tied embeddings keeps its tie through
FSDP2 sharding, and the sharded model's logits equal Hugging Face's.

Usage: torchrun --nproc-per-node 2 tests/gloo/tied_probe.py MODEL_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from areal_cli.config.allocation import parse_allocation
from areal_cli.config.schema import FSDPEngineConfig
from areal_cli.rundir.process import exit_without_teardown
from areal_cli.trainer.mesh import build_mesh
from areal_cli.trainer.parallelize import build_sharded_model


def main() -> None:
    model_dir = Path(sys.argv[1])
    allocation = sys.argv[2] if len(sys.argv) > 2 else "embedded:d1+fsdp:d2"
    dist.init_process_group("gloo")
    mesh = build_mesh("cpu", parse_allocation(allocation).train)
    model = build_sharded_model(model_dir, mesh, FSDPEngineConfig())
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tie lost"
    probe = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=probe, use_cache=False).logits
    if mesh.tp > 1:  # split over the vocabulary
        parts = [torch.empty_like(logits) for _ in range(mesh.tp)]
        dist.all_gather(parts, logits.contiguous(), group=mesh.tp_group())
        logits = torch.cat(parts, dim=-1)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=probe).logits
    diff = float((logits - expected).abs().max())
    assert diff < 1e-5, f"sharded logits differ from HF by {diff}"
    if dist.get_rank() == 0:
        print(f"TIED-OK {diff:.2e}", flush=True)
    dist.barrier()
    exit_without_teardown()  # gloo's teardown can abort a finished rank


if __name__ == "__main__":
    main()
