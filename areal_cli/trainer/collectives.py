"""The trainer's collectives: the one module of the trainer that calls torch.distributed.

The rule it keeps: a collective runs on tensors on the device its group expects. NCCL
has no CPU tensors (a host tensor fails with "No backend type associated with device type
cpu"), and gloo is for host tensors. So every function here takes a tensor from wherever
the caller made it (the step's counters are host tensors, its sums live beside the
model), moves it to the group's device (`device`: cuda under NCCL, cpu under gloo),
runs the collective there, and hands the result back on the caller's device. A sharded
tensor (`full_tensor`) is gathered on its mesh's device even where its shard was offloaded
to host memory. Object collectives (`broadcast_object`, `all_gather_object`) pickle
through the group's device too, which under NCCL is the rank's GPU
(`init` sets it).

Every rank must call the same functions in the same order, whatever its shard holds;
the callers' docstrings say how they keep that. Without an initialized process group
(a unit test, one process) each function is what it would be on a world of one.

Nothing else in areal_cli calls torch.distributed's collectives, apart from the
weight-update group between the trainer's rank 0 and the servers
(areal_cli.rundir.weight_group), which is not the trainer's group. Tests hold that:
tests/unit/test_collectives_owner.py reads the source, and every gloo test's ranks run
under tests/gloo/guard.py, which fails a collective issued from anywhere else or on a
tensor on the wrong device.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

Op = Literal["sum", "max"]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def init(use_cuda: bool, timeout_s: float) -> str:
    """Start the trainer's process group: NCCL on GPUs (each rank on its LOCAL_RANK
    device), gloo on CPUs. Returns the device type, "cuda" or "cpu"."""
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return "cuda" if use_cuda else "cpu"


def active() -> bool:
    """Whether a process group is up (else every function acts on a world of one)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def note(text: str) -> None:
    """One line on stderr from rank 0 only (what the trainer chose, said once)."""
    if rank() == 0:
        print(f"[trainer] {text}", file=sys.stderr, flush=True)


def device(group: Any = None) -> torch.device:
    """The device `group`'s collectives take their tensors on (the default group when
    None): the rank's GPU under NCCL, the host under gloo or with no group at all."""
    if active() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: Op = "sum", group: Any = None) -> torch.Tensor:
    """The reduction of `tensor` over `group` (every rank, when None), as a new tensor on
    `tensor`'s device; `tensor` itself is left alone."""
    if not active():
        return tensor.clone()
    here = device(group)
    out = tensor.detach().to(here, copy=True)
    dist.all_reduce(out, op=_OPS[op], group=group)
    return out.to(tensor.device)


def reduce_values(values: list[Any], op: Op = "sum", group: Any = None) -> list[float]:
    """Python floats or 0-d tensors (on any device), reduced element-wise over `group` in
    one collective of float64: every rank must give as many values, in the same order."""
    if not values:
        return []
    here = device(group)
    stacked = torch.stack(
        [torch.as_tensor(v, dtype=torch.float64).to(here).reshape(()) for v in values]
    )
    return all_reduce(stacked, op, group).tolist()


def max_in_place(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The element-wise maximum of `tensor` over `group`, for a tensor that already lives
    on the group's device (logits' statistics); it is not part of any autograd graph."""
    if not active():
        return tensor
    _check_device(tensor, group)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


class _SumOverShards(torch.autograd.Function):
    """All-reduce SUM whose backward passes the gradient through unchanged: every rank of
    the group computes the same loss from the sum, so each shard's gradient is its own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        _check_device(out, group)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_shards(x: torch.Tensor, group: Any) -> torch.Tensor:
    """SUM over `group` of a tensor on the group's device (logits split over the
    vocabulary), differentiable as the shards' own (see _SumOverShards)."""
    if not active():
        return x
    return _SumOverShards.apply(x, group)


class _AllToAll(torch.autograd.Function):
    """Chunk i of dim 0 to rank i of the group, chunk i of the result from rank i. The
    gradient of the chunk received from rank i belongs to rank i: the backward is the
    same exchange. Written on c10d's all_to_all_single rather than the functional one:
    the functional collective has had autograd only in recent torch (it has none in some
    of the versions a GPU machine runs, where gradients would pass through it wrong)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None


def all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i of `group`; chunk i of the result came from rank i.
    Differentiable: the backward is the same exchange in reverse. `x` lives on the
    group's device (activations of the model); its dim 0 divides by the group's size."""
    _check_device(x, group)
    return _AllToAll.apply(x, group)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (DTensor) gathered whole, on its mesh's device; a plain tensor as
    it is. A shard offloaded to host memory (fsdp.offload_params, a colocated trainer) is
    moved to the mesh's device first: the gather runs there."""
    if not hasattr(tensor, "full_tensor"):
        return tensor
    mesh = tensor.device_mesh
    local = tensor.to_local()
    if local.device.type != mesh.device_type:
        from torch.distributed.tensor import DTensor

        index = torch.cuda.current_device() if mesh.device_type == "cuda" else None
        on_mesh = local.to(torch.device(mesh.device_type, index))
        tensor = DTensor.from_local(
            on_mesh, mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
        )
    return tensor.full_tensor()


def barrier() -> None:
    """Every rank waits here for the others (on the group's device under NCCL)."""
    if not active():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` (picklable), on every rank."""
    if world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, device=device())
    return holder[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` (of `group`, default the world), in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    # pickles through the current device (init set it)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def any_on_rank0(flag: bool) -> bool:
    """Whether `flag` holds on rank 0, told to every rank."""
    return bool(broadcast_object(bool(flag), src=0))


def _check_device(tensor: torch.Tensor, group: Any) -> None:
    """A tensor that should already be on the group's device is, or this says where it
    is (a clearer error than NCCL's)."""
    want = device(group)
    if tensor.device.type != want.type:
        raise RuntimeError(
            f"a collective of the trainer got a tensor on {tensor.device}, but its group "
            f"runs on {want.type} ({dist.get_backend(group)})"
        )
