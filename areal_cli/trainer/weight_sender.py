"""The trainer's side of the distributed weight update (`actor.weight_update.method:
distributed`; the protocol is areal_cli.rundir.weight_group).

Rank 0 is rank 0 of the weight-update group. Joining is announced first: rank 0 writes
RUN/weights/group.json with a fresh token, which tells the controller to have every
server join, and then waits in the group's rendezvous (the collective timeout bounds it).
A relaunched trainer writes a new token, so the servers join its group, not the dead one's.

Publishing version K (collective over the trainer's ranks):
  1. rank 0 renames the entry RUN/weights/vK into place: its manifest says
     `method: distributed`, the group's token and the buckets (names, dtypes, shapes);
  2. bucket by bucket, every rank gathers each tensor whole (`full_tensor()` of a sharded
     one, a collective of the trainer's group), and rank 0 broadcasts the bucket to the
     servers, who receive it as the controller asks them to.
A send that fails (a server died) closes rank 0's side of the group, so the servers'
receives fail at once instead of waiting out the timeout; every rank learns of it (one
small broadcast), rank 0 forms a new group, which the controller has every server join
(a restarted one once it is up), and the version is sent again: ATTEMPTS sends in all.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from areal_cli.rundir import handoff
from areal_cli.rundir.paths import version_name
from areal_cli.rundir.weight_group import (
    METHOD,
    PYNCCL,
    Group,
    GroupSpec,
    TensorMeta,
    announce_group,
    buckets,
    dtype_name,
    member_left,
    own_address,
)
from areal_cli.trainer import collectives

ATTEMPTS = 3  # sends of one version, each in a new group, before the trainer gives up


class WeightSendFailed(RuntimeError):
    """A version could not be sent to the servers (the message says where it stopped)."""


def sent_items(model: nn.Module) -> list[tuple[str, torch.Tensor, float]]:
    """The tensors a version holds, by checkpoint name, in the order they travel (the
    exported folder's: a tied lm_head is left out, as there), each with the factor it is
    sent times. A LoRA model sends its adapters only (`...lora_A`, `...lora_B`), B times
    the adapter's scale alpha / r, so that a receiver merges W + B A with no config."""
    from areal_cli.models.lora import LoraLinear, adapter_state

    scales = {f"{n}.lora_B": m.scale for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    if scales:
        return [(k, v, scales.get(k, 1.0)) for k, v in adapter_state(model).items()]
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    items = model.state_dict().items()
    return [(k, v, 1.0) for k, v in items if not (tied and k == "lm_head.weight")]


class WeightSender:
    """Rank 0's membership of the group, and the publishing of versions."""

    def __init__(self, spec: GroupSpec, weights_dir: Path, bucket_bytes: int) -> None:
        self.spec, self.weights_dir, self.bucket_bytes = spec, weights_dir, bucket_bytes
        self.group: Group | VLLMGroup | None = None
        self.token = ""
        self.groups = 0  # formed so far: the first takes the plan's port, later ones a free one

    def join(self) -> None:
        """Rank 0: announce a new group and wait until every server is in it."""
        if collectives.rank() != 0:
            return
        self.token = token = secrets.token_hex(6)
        address = own_address(self.spec.master_address)
        # its store is here; a torch group formed again takes a free port (0: the store
        # picks one), since one aborted with sends in flight keeps its port (Group.abort).
        # vLLM's helper needs the port itself, and its group is never aborted: a stuck one
        # fails the next join, and the trainer's relaunch sets the group up again.
        again = self.groups > 0 and self.spec.protocol != PYNCCL
        port = 0 if again else self.spec.master_port
        here = dataclasses.replace(self.spec, master_address=address, master_port=port)
        self.groups += 1
        start = time.perf_counter()
        ports: list[int] = []

        def announce(port: int) -> None:
            ports.append(port)
            announce_group(self.weights_dir, token, address, port)

        if here.protocol == PYNCCL:
            announce(here.master_port)
            self.group = VLLMGroup(here)
        else:
            self.group = Group(here, 0, self.device, on_store=announce)
        print(
            f"[trainer] weight-update group {self.token}: {self.spec.world_size} members on "
            f"{address}:{ports[0]} ({self.spec.backend}), joined in "
            f"{time.perf_counter() - start:.2f}s",
            flush=True,
        )

    @torch.no_grad()
    def publish(self, version: int, model: nn.Module, meta: dict[str, Any], keep_last: int) -> None:
        """Send the model as version `version` (collective over the trainer's ranks). A
        send that fails is tried again in a new group (the controller has every server,
        a restarted one too, join it), up to ATTEMPTS times."""
        meta = {**meta, "publish_started": time.time()}  # the handoff figures start here
        items = sent_items(model)
        plan = buckets(
            [(n, dtype_name(t.dtype), list(t.shape)) for n, t, _ in items], self.bucket_bytes
        )
        rank = collectives.rank()
        failure = None
        for attempt in range(1, ATTEMPTS + 1):
            if rank == 0:
                if self.group is None:
                    self.join()
                entry_meta = {**meta, "method": METHOD, "group": self.token, "buckets": plan}
                tmp = handoff.new_tmp_dir(self.weights_dir, version_name(version))
                final = self.weights_dir / version_name(version)
                handoff.finish_entry(tmp, final, version, [], entry_meta)
            failure = self._send(items, plan, version)
            if not collectives.any_on_rank0(failure is not None):
                break
            if rank == 0:
                print(f"[trainer] {failure}; attempt {attempt} of {ATTEMPTS}", flush=True)
        else:
            raise WeightSendFailed(failure or f"sending v{version} failed on rank 0")
        if rank == 0:
            handoff.gc(self.weights_dir, "v", keep_last)

    def _send(
        self,
        items: list[tuple[str, torch.Tensor, float]],
        plan: list[list[TensorMeta]],
        version: int,
    ) -> str | None:
        """Every rank gathers each tensor of a bucket, rank 0 broadcasts the bucket; rank
        0 returns why it failed (None: sent). After a failure rank 0 still gathers, so
        every rank walks the same collectives, and it leaves the group, so the servers'
        receives end now instead of at the timeout."""
        rank = collectives.rank()
        failure = None
        tensors = iter(items)
        for n, bucket in enumerate(plan):
            gathered = []
            for _ in bucket:
                _, tensor, factor = next(tensors)
                full = collectives.full_tensor(tensor).detach()
                gathered.append((full * factor if factor != 1.0 else full).contiguous())
            if rank != 0 or failure is not None:
                continue
            try:
                assert self.group is not None
                on_group = [t.to(self.device) for t in gathered]  # NCCL: the GPU
                self.group.broadcast(on_group, self._member_left)
            except Exception as exc:  # a server died, or the collective timed out
                failure = f"sending bucket {n + 1} of {len(plan)} of v{version} failed: {_why(exc)}"
                self.close()
        return failure

    @property
    def device(self) -> torch.device:
        """Where rank 0 sends from: the weight group's device (this rank's GPU under
        NCCL, the host under gloo), whatever device the trainer's shards are on."""
        if self.spec.backend == "nccl" or self.spec.protocol == PYNCCL:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _member_left(self) -> bool:
        """Whether the controller saw a server of the current group die."""
        return member_left(self.weights_dir, self.token)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class VLLMGroup:
    """Rank 0 of a vLLM weight-transfer group (`GroupSpec.protocol` PYNCCL). vLLM's
    servers make their side with vLLM's StatelessProcessGroup and PyNccl, so rank 0 joins
    with vLLM's own trainer-side helper (vllm in the trainer's Python: the vLLM backend's
    rules check it), and sends unpacked, one NCCL broadcast per tensor in the bucket's
    order, as its engine receives with `packed: false` (inference.backends.vllm). NCCL
    broadcasts have no timeout of their own: the wait for each bucket has the group's."""

    def __init__(self, spec: GroupSpec) -> None:
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
        except ImportError as exc:
            raise WeightSendFailed(
                f"the vLLM backend's distributed weight update needs vllm in the trainer's "
                f"Python: {exc}"
            ) from exc
        self.spec = spec
        rendezvous = {
            "master_address": spec.master_address,
            "master_port": spec.master_port,
            "world_size": spec.world_size,
        }
        self.comm: Any = trainer_init(rendezvous, rank=0)
        self.stuck = False

    def broadcast(
        self, tensors: list[torch.Tensor], member_left: Callable[[], bool] | None = None
    ) -> None:
        import threading

        stream = torch.cuda.current_stream()
        for tensor in tensors:
            self.comm.broadcast(tensor, src=0, stream=stream)
        done = threading.Thread(target=stream.synchronize, daemon=True)
        done.start()
        done.join(self.spec.timeout_s)
        if done.is_alive():
            self.stuck = True  # a communicator with a broadcast in flight cannot be destroyed
            raise TimeoutError(f"a bucket's broadcasts did not finish in {self.spec.timeout_s:g}s")

    def close(self) -> None:
        if not self.stuck:
            self.comm.destroy()


def _why(exc: BaseException) -> str:
    """gloo's error in one line: without its source location and its general advice."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]
