"""How one trainer rank takes part in a step (built from the mesh by mesh.step_layout;
read by the step, the critic and the supervised roles)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from areal_cli.trainer.attention import PackedAttention, installed
from areal_cli.trainer.losses import VocabShard


@dataclass(frozen=True)
class StepLayout:
    """How this rank takes part in a step; `data_parallel()` when there is no mesh."""

    dp_rank: int = 0
    dp_size: int = 1
    data_world: int = 1  # ranks holding different tokens (FSDP averages gradients over them)
    stats_group: Any = None  # where per-token sums are reduced; None: the whole world
    vocab: VocabShard | None = None  # the LM head's logits are split (tensor parallel)
    cp_rank: int = 0  # context parallel: this rank's slice of each micro-batch's positions
    cp_size: int = 1
    cp_group: Any = None
    # the models' attention, which each forward tells its micro-batch (default: the one
    # installed in transformers, for a step without a mesh)
    attention: PackedAttention = field(default_factory=installed)

    @classmethod
    def data_parallel(cls) -> StepLayout:
        """Every rank of the world is a data-parallel rank (or the only process)."""
        if not dist.is_initialized():
            return cls()
        world = dist.get_world_size()
        return cls(dist.get_rank(), world, world)
