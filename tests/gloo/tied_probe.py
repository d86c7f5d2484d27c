"""Run under torchrun by test_trainer.py: a model with tied embeddings keeps its tie through
FSDP2 sharding, and the sharded model's logits equal Hugging Face's.

Usage: torchrun --nproc-per-node 2 tests/gloo/tied_probe.py MODEL_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from areal_cli.config.schema import FSDPEngineConfig
from areal_cli.trainer.parallelize import build_sharded_model


def main() -> None:
    model_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_sharded_model(model_dir, mesh, FSDPEngineConfig())
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tie lost"
    probe = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=probe, use_cache=False).logits
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=probe).logits
    diff = float((logits - expected).abs().max())
    assert diff < 1e-5, f"sharded logits differ from HF by {diff}"
    if dist.get_rank() == 0:
        print(f"TIED-OK {diff:.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
