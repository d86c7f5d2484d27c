"""The distributed weight update's wire protocol (`actor.weight_update.method: distributed`):
one process group of the trainer's rank 0 and every server, and the order tensors take.

The group is made as SGLang makes its weight-update group, so the trainer speaks to SGLang
servers and to the embedded server alike:
  - the trainer's rank 0 is group rank 0 and hosts a TCP store at the group's master
    address and port; server k joins as rank `rank_offset + its TP rank`
    (`/init_weights_update_group` with master_address, master_port, rank_offset,
    world_size, group_name, backend);
  - the group's store keys live under `GROUP_NAME/DEVICE/` (as torch's own group helper,
    which SGLang uses, puts them), and each member builds a gloo (CPU) or NCCL (GPU) group
    of `world_size` ranks on that store, with the run's collective timeout, so no member
    waits for ever;
  - a version travels as one broadcast from rank 0 per tensor, in the order of the
    version's bucket list; a server receives a bucket per
    `/update_weights_from_distributed` call (names, dtypes, shapes) and the call that
    carries `weight_version` is the last one.

Only the trainer's rank 0 is in the group: the other trainer ranks help gather a sharded
tensor (FSDP2 and TP) inside the trainer's own group, one bucket at a time, so no rank
holds more than one bucket of whole tensors beyond its shards.

vLLM makes its side of the group its own way (`GroupSpec.protocol` PYNCCL; its routes and
the bodies are inference.backends.vllm's, the trainer's side trainer.weight_sender's);
the ranks, the order of the tensors and the announcements below are the same.

Where the group meets: the plan names the trainer's first node (127.0.0.1 on one machine,
HEAD_NODE under a cluster launcher, which the runner fills in), and the trainer's rank 0
says its own address in RUN/weights/group.json with each new group (`own_address`), which
the controller gives the servers: torchrun's rendezvous, not the plan, decides which node
rank 0 runs on.

The trainer announces each version as a handoff entry RUN/weights/vK whose manifest holds
`method: distributed` and the buckets, renamed into place before the first broadcast;
the controller reads it and asks the servers for the buckets in order.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.rundir.handoff import write_json_atomic

if TYPE_CHECKING:
    import torch

GROUP_NAME = "areal_weight_update"
METHOD = "distributed"
GROUP_FILE = "group.json"  # RUN/weights/group.json: the trainer's newest group, by token
LEFT_PREFIX = ".left-"  # RUN/weights/.left-TOKEN: a member of that group died (mark_left)

# How the members make the group, by `GroupSpec.protocol`, as --dry-run says it. Each
# backend names its own (InferenceBackend.group_protocol).
TORCH_GROUP = "torch"  # torch's group on the TCP store below, as SGLang makes it
PYNCCL = "pynccl"  # vLLM's StatelessProcessGroup and PyNccl (its NCCL weight-transfer engine)
PROTOCOLS = {TORCH_GROUP: "SGLang's weight-update group", PYNCCL: "vLLM's weight transfer"}

# (name, dtype without "torch.", shape) of one tensor, as /update_weights_from_distributed
# lists them
TensorMeta = tuple[str, str, list[int]]


@dataclass(frozen=True)
class GroupSpec:
    """Where and how the group meets; every member gets the same spec."""

    master_address: str
    master_port: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float
    group_name: str = GROUP_NAME
    # how the members make the group (PROTOCOLS): TORCH_GROUP (below: SGLang's servers and
    # the embedded one) or PYNCCL (vLLM's NCCL weight-transfer engine)
    protocol: str = TORCH_GROUP

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupSpec:
        return cls(**data)

    def init_body(self, rank_offset: int) -> dict[str, Any]:
        """The body of SGLang's /init_weights_update_group for a server at `rank_offset`."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": self.backend,
        }


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16", as the request's dtypes spell it."""
    return str(dtype).removeprefix("torch.")


def buckets(tensors: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive tensors in buckets of at most `bucket_bytes` (a bigger tensor has its
    own); the order is kept, since it is the order of the broadcasts."""
    import torch

    out: list[list[TensorMeta]] = []
    size = 0
    for meta in tensors:
        nbytes = math.prod(meta[2]) * getattr(torch, meta[1]).itemsize
        if out and size + nbytes <= bucket_bytes:
            out[-1].append(meta)
            size += nbytes
        else:
            out.append([meta])
            size = nbytes
    return out


def update_body(
    bucket: list[TensorMeta], version: str | None, group_name: str = GROUP_NAME
) -> dict[str, Any]:
    """The body of SGLang's /update_weights_from_distributed for one bucket; `version` is
    given on the last bucket only (the server then serves the whole version)."""
    return {
        "names": [m[0] for m in bucket],
        "dtypes": [m[1] for m in bucket],
        "shapes": [list(m[2]) for m in bucket],
        "group_name": group_name,
        "flush_cache": version is not None,
        "weight_version": version,
    }


def announce_group(weights_dir: Path, token: str, master_address: str, master_port: int) -> None:
    """The trainer's rank 0 forms a group: RUN/weights/group.json takes `token` and the
    address and port its store listens on (written to a temp file and renamed into
    place)."""
    weights_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "token": token,
        "master_address": master_address,
        "master_port": master_port,
        "created": time.time(),
    }
    write_json_atomic(weights_dir / GROUP_FILE, record)


@dataclass(frozen=True)
class Announced:
    """The trainer's newest group as RUN/weights/group.json says it ('' and 0 before the
    first)."""

    token: str = ""
    master_address: str = ""
    master_port: int = 0


def announced_group(weights_dir: Path) -> Announced:
    """The trainer's newest group, read at once."""
    try:
        record = json.loads((weights_dir / GROUP_FILE).read_text())
        return Announced(
            str(record["token"]),
            str(record.get("master_address") or ""),
            int(record.get("master_port") or 0),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return Announced()


def mark_left(weights_dir: Path, token: str) -> None:
    """The controller saw a member of group `token` die: the trainer's rank 0 stops
    waiting on its sends there (`Group.broadcast`). gloo does not notice a receiver that
    dies in the middle of a send (the send then waits out the timeout); the controller,
    which restarts the server, does."""
    (weights_dir / f"{LEFT_PREFIX}{token}").touch()


def member_left(weights_dir: Path, token: str) -> bool:
    """Whether the controller said a member of group `token` died."""
    return (weights_dir / f"{LEFT_PREFIX}{token}").exists()


def group_token(weights_dir: Path) -> str:
    """The token of the trainer's newest group ('' before the first)."""
    return announced_group(weights_dir).token


def own_address(toward: str) -> str:
    """This machine's address as a peer at `toward` reaches it: the source address of a
    route to `toward` (a UDP socket is only routed, nothing is sent). Under a cluster
    launcher the trainer's rank 0 is on whichever node torchrun's rendezvous made node 0,
    not necessarily the plan's first node, so it says its own address (`announce_group`)."""
    import socket

    if toward in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((toward, 9))
            return str(sock.getsockname()[0])
    except OSError:  # no route (or not an IPv4 name): the plan's address
        return toward


_ABORTED: list[Any] = []  # aborted groups and their stores (Group.abort)


class Group:
    """This process's membership of the group (rank 0 hosts the store)."""

    def __init__(
        self,
        spec: GroupSpec,
        rank: int,
        device: torch.device | None = None,
        on_store: Callable[[int], None] | None = None,
    ) -> None:
        """Rank 0 hosts the store (on a free port when the spec's is 0) and calls
        `on_store(port)` before it waits for the others."""
        import torch
        import torch.distributed as dist

        self.spec, self.rank = spec, rank
        self.device = device or torch.device("cpu")
        self.aborted = False
        timeout = timedelta(seconds=spec.timeout_s)
        self._store = dist.TCPStore(
            spec.master_address,
            spec.master_port,
            spec.world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        if on_store is not None:
            on_store(self._store.port)
        # the keys torch's own group helper uses (GROUP/DEVICE/...), as SGLang's servers
        # make their side of the group with it
        device_type = "cuda" if spec.backend == "nccl" else "cpu"
        prefixed = dist.PrefixStore(
            f"{device_type}/", dist.PrefixStore(f"{spec.group_name}/", self._store)
        )
        if spec.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)

    def broadcast(
        self, tensors: list[torch.Tensor], member_left: Callable[[], bool] | None = None
    ) -> None:
        """Rank 0 sends `tensors`; every other rank receives into them: one broadcast per
        tensor, all issued at once and then waited for (the group's threads carry several
        at a time, as SGLang's receiver issues them), in the same order on every rank.
        While it waits, `member_left()` says whether a member died: then the group is
        aborted and this raises (see `mark_left`)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.spec.timeout_s)
        works = [self.pg.broadcast([tensor], opts) for tensor in tensors]
        if member_left is not None:
            pause = 0.0005
            while not all(work.is_completed() for work in works):
                if member_left():
                    self.abort()
                    raise RuntimeError("a member of the group died during the send")
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
        for work in works:
            work.wait()  # raises the error of a failed one

    def abort(self) -> None:
        """Give up the group with sends in flight. The aborted group is kept referenced:
        its destructor would wait for those sends to time out, and its store keeps its
        port, so the next group takes another (WeightSender)."""
        self.pg.abort()
        _ABORTED.append((self.pg, self._store))
        self.aborted = True

    def close(self) -> None:
        """Leave the group (the store closes with the last reference)."""
        if self.aborted:
            self.pg = self._store = None
            return
        try:
            self.pg.shutdown()  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):
            pass
        self.pg = None
        self._store = None
