"""Runs a gloo test's rank under the collectives guard (every rank of every gloo test).

Usage: torchrun ... -m tests.gloo.guard -m MODULE [ARGS ...]
       torchrun ... -m tests.gloo.guard SCRIPT.py [ARGS ...]

NCCL takes only CUDA tensors, so a host tensor in a collective of the trainer's group
crashes every GPU run, yet passes on gloo, where everything is on the host. No CPU run
can see the tensor's device go wrong; what it can see is where the collective came from.
The trainer keeps its collectives in one module (areal_cli.trainer.collectives), which
moves every tensor to the group's device. This guard wraps torch.distributed's
collectives (and DTensor.full_tensor) in the rank and fails the first one that areal
code issues from anywhere else: the caller's frame (the first one outside torch's c10d
wrappers) must be collectives.py or the weight-update group's module; a collective that
torch issues for FSDP2, DTensor or DCP is torch's own. It also checks each tensor
against its group's backend, which on a GPU run is the device rule itself. A violation
raises AssertionError naming the function and the caller's file and line, so the rank
fails and the test says why.
"""

from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

OWNERS = ("areal_cli/trainer/collectives.py", "areal_cli/rundir/weight_group.py")
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "barrier",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)  # fmt: skip
# frames of torch's wrappers around the collective itself (logging, the object helpers)
_HERE = str(Path(__file__).resolve())
_WRAPPERS = ("torch/distributed/distributed_c10d.py", "torch/distributed/c10d_logger.py")


def _caller() -> tuple[str, int]:
    """The first frame outside this guard and torch's c10d wrappers."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if name != _HERE and not name.endswith(_WRAPPERS):
            return name, frame.f_lineno
        frame = frame.f_back
    return "?", 0


def _check_route(what: str) -> None:
    name, line = _caller()
    if "/areal_cli/" in name and not name.endswith(OWNERS):
        where = name[name.index("areal_cli/") :]
        raise AssertionError(
            f"collectives guard: {what} issued from {where}:{line}; the trainer's collectives "
            "go through areal_cli.trainer.collectives (on the group's device)"
        )


def _check_devices(what: str, args: tuple, kwargs: dict) -> None:
    group = kwargs.get("group")
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):
        return  # a group this rank is not in, or a custom one
    want = "cuda" if backend == "nccl" else "cpu"
    tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
    tensors += [t for a in args if isinstance(a, list) for t in a if torch.is_tensor(t)]
    for tensor in tensors:
        if tensor.device.type != want:
            raise AssertionError(
                f"collectives guard: {what} on a {tensor.device} tensor in a {backend} group"
            )


def _wrap(module: Any, name: str) -> None:
    original = getattr(module, name, None)
    if original is None or getattr(original, "_guarded", False):
        return

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_route(name)
        _check_devices(name, args, kwargs)
        return original(*args, **kwargs)

    guarded._guarded = True  # type: ignore[attr-defined]
    setattr(module, name, guarded)


def install() -> None:
    """Wrap the collectives where areal code would reach them."""
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.tensor import DTensor

    for name in COLLECTIVES:
        _wrap(dist, name)
    for name in ("all_to_all_single", "all_reduce", "all_gather_tensor", "reduce_scatter_tensor"):
        _wrap(funcol, name)
    full = DTensor.full_tensor

    def full_tensor(self: DTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        _check_route("DTensor.full_tensor")
        return full(self, *args, **kwargs)

    DTensor.full_tensor = full_tensor  # type: ignore[method-assign]


def main() -> None:
    install()
    argv = sys.argv[1:]
    if argv and argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
