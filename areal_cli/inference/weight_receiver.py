"""The embedded server's side of the distributed weight update (SGLang's three routes).

  /init_weights_update_group       join the group (areal_cli.rundir.weight_group) at
                                   `rank_offset`; blocks until every member has joined
  /update_weights_from_distributed receive one bucket (names, dtypes, shapes: one
                                   broadcast per tensor, in that order) into new tensors;
                                   the call that carries `weight_version` hands the whole
                                   version to the engine, which swaps it in at a decode-step
                                   boundary (submit_received_weights)
  /destroy_weights_update_group    leave it

Decoding goes on while the buckets arrive: the received tensors are staging, not the
weights in use, so a version is served whole or not at all. A bucket that fails (a
member died, the collective timed out) drops what was staged and leaves the group: the
server keeps serving its last whole version and must be asked to join again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from areal_cli.rundir.weight_group import Group, GroupSpec

logger = logging.getLogger("areal_cli.inference.server")


class ReceiveError(Exception):
    """A request the receiver cannot serve (the message says why)."""


class WeightReceiver:
    """This server's membership of the weight-update group, and the version being received."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device, self.timeout_s = device, timeout_s
        self.group: Group | None = None
        self.staged: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # one request at a time touches the group

    def join(self, body: dict[str, Any]) -> str:
        """Join the group `body` describes (SGLang's InitWeightsUpdateGroupReqInput)."""
        try:
            spec = GroupSpec(
                master_address=str(body["master_address"]),
                master_port=int(body["master_port"]),
                world_size=int(body["world_size"]),
                backend=str(body.get("backend", "nccl")),
                timeout_s=self.timeout_s,
                group_name=str(body.get("group_name", "weight_update_group")),
            )
            rank = int(body["rank_offset"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ReceiveError(f"bad /init_weights_update_group body: {exc!r}") from None
        if spec.backend == "nccl" and self.device.type != "cuda":
            raise ReceiveError(
                f"backend nccl needs a CUDA device; this server runs on {self.device}"
            )
        if not 0 < rank < spec.world_size:
            raise ReceiveError(f"rank_offset {rank} is outside 1..{spec.world_size - 1}")
        with self._lock:
            self._leave()
            self.group = Group(spec, rank, self.device)  # blocks until all have joined
        logger.info(
            "joined weight-update group %s as rank %d of %d", spec.group_name, rank, spec.world_size
        )
        return f"joined {spec.group_name} as rank {rank} of {spec.world_size}"

    def receive(self, body: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """Receive one bucket; returns the whole staged version when `body` carries
        `weight_version` (the last bucket), else None."""
        try:
            names = [str(n) for n in body["names"]]
            dtypes = [_dtype(d) for d in body["dtypes"]]
            shapes = [tuple(int(x) for x in s) for s in body["shapes"]]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ReceiveError(f"bad /update_weights_from_distributed body: {exc!r}") from None
        if not len(names) == len(dtypes) == len(shapes):
            raise ReceiveError("names, dtypes and shapes must have the same length")
        with self._lock:
            group = self.group
            if group is None:
                raise ReceiveError(
                    "this server is in no weight-update group: call "
                    "/init_weights_update_group first"
                )
            if body.get("group_name", group.spec.group_name) != group.spec.group_name:
                raise ReceiveError(
                    f"this server is in group {group.spec.group_name!r}, "
                    f"not {body.get('group_name')!r}"
                )
            try:
                tensors = [
                    torch.empty(shape, dtype=dtype, device=self.device)
                    for dtype, shape in zip(dtypes, shapes, strict=True)
                ]
                group.broadcast(tensors)
                self.staged.update(zip(names, tensors, strict=True))
            except Exception as exc:  # a member died or timed out: the group is broken
                self.staged = {}
                self._leave()
                raise ReceiveError(f"receiving {len(names)} tensors failed: {exc}") from exc
            if body.get("weight_version") is None:
                return None
            version, self.staged = self.staged, {}
            return version

    def leave(self) -> None:
        with self._lock:
            self._leave()

    def _leave(self) -> None:
        self.staged = {}
        if self.group is not None:
            self.group.close()
            self.group = None


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
