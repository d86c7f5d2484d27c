"""The trainer's device mesh: data, context and tensor parallel dims on one mesh.

The allocation's fsdp component gives the sizes (`fsdp:d2t2` = 4 ranks: dp 2, tp 2); `d`
is whatever the launched world leaves after `c` and `t` (so a data-parallel checkpoint
resumes on any number of ranks). Ranks are laid out with tp innermost, as torchtitan and
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

from areal_cli.config.allocation import parse_allocation
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


def layout_sizes(allocation_mode: str, world: int) -> tuple[int, int, int]:
    """(dp, cp, tp) for `world` ranks under the allocation's fsdp component."""
    train = parse_allocation(allocation_mode).train
    cp = train.context_parallel_size if train else 1
    tp = train.tensor_parallel_size if train else 1
    if world % (cp * tp):
        raise ValueError(
            f"{world} trainer ranks cannot form c{cp} x t{tp} groups; launch a multiple of {cp * tp}"
        )
    return world // (cp * tp), cp, tp


def build_mesh(device_type: str, allocation_mode: str) -> TrainerMesh:
    """The mesh of this torchrun world (collective: every rank calls it)."""
    dp, cp, tp = layout_sizes(allocation_mode, dist.get_world_size())
    mesh = init_device_mesh(device_type, (dp, cp, tp), mesh_dim_names=DIMS)
    return TrainerMesh(mesh, mesh["dp", "cp"]._flatten("dp_cp"), dp, cp, tp)


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
    )
