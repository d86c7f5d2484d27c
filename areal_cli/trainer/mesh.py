"""The trainer's device mesh: data, context and tensor parallel dims on one mesh.

The train side of the allocation (a `ParallelStrategy`, parsed by the launcher and
given to the trainer as --dp/--cp/--tp) gives the sizes (`fsdp:d2t2` = 4 ranks: dp 2,
tp 2); it must cover the launched world exactly. Ranks are laid out with tp innermost, as torchtitan and
Megatron do, so a tensor-parallel group is a block of neighbouring ranks.

Who does what:
  dp   ranks with different dp coordinates get different sequences of the batch;
  cp   ranks of one cp group split each micro-batch's tokens (Ulysses; see
       attention.py);
  tp   ranks of one tp group hold slices of the same layers and see the same tokens.
FSDP2 shards parameters (and reduces gradients) over the dp x cp ranks that share a tp
coordinate. Sums of per-token statistics are reduced over the same group, so the tp
replicas of a token are counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from areal_cli.config.schema import ParallelStrategy
from areal_cli.trainer.attention import PackedAttention
from areal_cli.trainer.layout import StepLayout
from areal_cli.trainer.losses import VocabShard

DIMS = ("dp", "cp", "tp")


@dataclass(frozen=True)
class TrainerMesh:
    """The 3-D mesh and the groups that the step, the loss and the export need."""

    mesh: DeviceMesh
    fsdp: DeviceMesh  # the ranks FSDP2 shards over: dp x cp, flattened to one dim
    dp: int
    cp: int
    tp: int
    attention: PackedAttention  # the models' attention (context parallel over the cp dim)

    @property
    def tensor(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def data_world(self) -> int:
        """How many ranks hold different tokens (FSDP averages gradients over them)."""
        return self.dp * self.cp

    def stats_group(self) -> dist.ProcessGroup:
        """Where per-token sums are reduced: one rank per token (dp x cp)."""
        return self.fsdp.get_group()

    def tp_group(self) -> dist.ProcessGroup | None:
        return self.tensor.get_group() if self.tp > 1 else None


def layout_sizes(strategy: ParallelStrategy, world: int) -> tuple[int, int, int]:
    """(dp, cp, tp) of `strategy`, which must cover the `world` launched ranks."""
    dp = strategy.data_parallel_size
    cp, tp = strategy.context_parallel_size, strategy.tensor_parallel_size
    if dp * cp * tp != world:
        raise ValueError(
            f"{world} trainer ranks cannot form d{dp} x c{cp} x t{tp}; launch {dp * cp * tp}"
        )
    return dp, cp, tp


def build_mesh(device_type: str, strategy: ParallelStrategy) -> TrainerMesh:
    """The mesh of this torchrun world (collective: every rank calls it)."""
    dp, cp, tp = layout_sizes(strategy, dist.get_world_size())
    mesh = init_device_mesh(device_type, (dp, cp, tp), mesh_dim_names=DIMS)
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    return TrainerMesh(mesh, flat, dp, cp, tp, PackedAttention(cp))


def step_layout(tmesh: TrainerMesh, vocab_size: int) -> StepLayout:
    """How this rank takes part in a training step (see trainer/step.py)."""
    vocab = None
    if tmesh.tp > 1:  # the LM head's rows (the vocabulary) are split like torch.chunk
        chunk = -(-vocab_size // tmesh.tp)
        start = min(tmesh.mesh.get_local_rank("tp") * chunk, vocab_size)
        vocab = VocabShard(tmesh.tp_group(), start)
    cp = tmesh.mesh["cp"]
    return StepLayout(
        tmesh.dp_rank,
        tmesh.dp,
        tmesh.data_world,
        tmesh.stats_group(),
        vocab,
        cp_rank=cp.get_local_rank(),
        cp_size=tmesh.cp,
        cp_group=cp.get_group() if tmesh.cp > 1 else None,
        attention=tmesh.attention,
    )
