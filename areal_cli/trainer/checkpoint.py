"""Recover checkpoints (DCP) and Hugging Face exports, both as handoff entries.

Recover: `RUN/recover/step-N/` holds a DCP checkpoint of the sharded model and optimizer
(under `dcp/`), plus `state.json` (step, scheduler, loop state) and one `rng-rankR.pt`
per rank. Every rank writes its DCP shard into the entry's temp directory; after a
barrier rank 0 records the files, writes the manifest and renames (see handoff). DCP
reshards on load, so a checkpoint from 2 ranks resumes on 1.

Export: `RUN/weights/vN/` (and `RUN/checkpoints/`) hold a plain HF folder: config,
tokenizer files and one `model.safetensors`, which every rank writes its shards into.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from areal_cli.rundir import handoff

RECOVER_PREFIX = "step-"


def _broadcast_object(obj: Any) -> Any:
    if dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def save_recover(
    parent: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write recover entry `step-N` collectively (every rank calls this)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    tmp_name = _broadcast_object(f".tmp-step-{step}-{uuid.uuid4().hex[:8]}" if rank == 0 else None)
    tmp = parent / tmp_name
    if rank == 0:
        parent.mkdir(parents=True, exist_ok=True)
        handoff.remove_stale(parent)
        tmp.mkdir()
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
    dist.barrier()
    final = parent / f"{RECOVER_PREFIX}{step}"
    if rank == 0:
        handoff.write_json_atomic(tmp / "state.json", state)
        meta = {"step": step, "world_size": dist.get_world_size()}
        handoff.finish_entry(tmp, final, step, handoff.record_tree(tmp), meta)
        handoff.gc(parent, RECOVER_PREFIX, keep_last)
    dist.barrier()
    return final


def load_recover(
    entry: handoff.Entry, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore model, optimizer and (same world size) RNG; returns state.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    model_sd, optim_sd = get_state_dict(model, optimizer)
    stored = FileSystemReader(str(entry.path / "dcp")).read_metadata().state_dict_metadata
    has_optim = any(k.startswith("optim.") for k in stored)  # converted HF weights have none
    target = {"model": model_sd, "optim": optim_sd} if has_optim else {"model": model_sd}
    dcp.load(target, checkpoint_id=str(entry.path / "dcp"))
    if has_optim:
        set_state_dict(
            model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
    else:
        set_model_state_dict(model, target["model"])
    rng_file = entry.path / f"rng-rank{dist.get_rank()}.pt"
    if entry.meta.get("world_size") == dist.get_world_size() and rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((entry.path / "state.json").read_text())


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# How `export_hf` writes one tensor: this rank's rows at an offset, the whole plain tensor
# (rank 0), the gathered `full_tensor()` (collective; rank 0 writes), or nothing here.
_ROWS, _WHOLE, _FULL, _NONE = "rows", "whole", "full", "none"


@dataclass(frozen=True)
class _ExportPlan:
    """What this rank writes where in `model.safetensors`, and from which tensors.

    Shapes, shardings and the storage behind each parameter do not change between steps
    (the optimizer updates in place), so the plan is built once per model and reused while
    `fingerprint` (every parameter's and buffer's name and storage address) is unchanged;
    that skips `state_dict()`, which costs more than writing a small model."""

    fingerprint: tuple
    header: bytes
    size: int
    writes: tuple[tuple[torch.Tensor | memoryview, str, int], ...]  # (source, how, offset)


def _fingerprint(model: nn.Module) -> tuple:
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    # A DTensor keeps its shard in `_local_tensor`; reading that attribute skips the
    # autograd call of `to_local()`, which would cost more than the rest of the check.
    return tuple((name, getattr(t, "_local_tensor", t).data_ptr()) for name, t in named)


def _build_plan(model: nn.Module, fingerprint: tuple) -> _ExportPlan:
    """FSDP2 shards every parameter along dim 0 in `torch.chunk` pieces, and the rows of a
    row-major tensor are contiguous bytes, so each rank can write its own rows straight
    into the exported file. Anything else is written whole by rank 0."""
    from areal_cli.rundir.safetensors_io import layout, tensor_bytes

    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    items = [(k, v) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")]
    header, starts, size = layout(tuple((k, v.dtype, tuple(v.shape)) for k, v in items))
    writes = []
    for name, value in items:
        how, offset = (_WHOLE if dist.get_rank() == 0 else _NONE), starts[name]
        if hasattr(value, "to_local"):
            how = _FULL
            mesh, placements, local = value.device_mesh, value.placements, value.to_local()
            if mesh.ndim == 1 and tuple(placements) == (Shard(0),):
                rows, chunk = value.shape[0], -(-value.shape[0] // mesh.size())
                start = min(mesh.get_local_rank() * chunk, rows)
                if local.shape[0] == min(start + chunk, rows) - start:
                    how, value = (_ROWS if local.shape[0] else _NONE), local
                    offset += start * math.prod(value.shape[1:]) * value.element_size()
        if how in (_ROWS, _WHOLE) and value.device.type == "cpu" and value.is_contiguous():
            value = tensor_bytes(value)  # a view of the parameter's memory: reused every step
        writes.append((value, how, offset))
    return _ExportPlan(fingerprint, header, size, tuple(writes))


_plans: weakref.WeakKeyDictionary[nn.Module, _ExportPlan] = weakref.WeakKeyDictionary()
_swept: set[Path] = set()  # parents whose crash leftovers this process already removed


def _export_plan(model: nn.Module) -> _ExportPlan:
    fingerprint = _fingerprint(model)
    plan = _plans.get(model)
    if plan is None or plan.fingerprint != fingerprint:
        plan = _plans[model] = _build_plan(model, fingerprint)
    return plan


_cleaner: concurrent.futures.ThreadPoolExecutor | None = None
_cleaning: concurrent.futures.Future | None = None


def _collect_in_background(parent: Path, prefix: str, keep_last: int) -> None:
    """Delete old entries while the next step trains: unlinking a few hundred MB takes
    longer than the whole rest of a publish, and nothing needs to wait for it."""
    global _cleaner, _cleaning
    wait_for_cleanup()
    _cleaner = _cleaner or concurrent.futures.ThreadPoolExecutor(1, "areal-gc")
    _cleaning = _cleaner.submit(handoff.gc, parent, prefix, keep_last)


def wait_for_cleanup() -> None:
    """Finish the pending background collection; re-raises its error, if any."""
    global _cleaning
    if _cleaning is not None:
        pending, _cleaning = _cleaning, None
        pending.result()


def export_hf(
    parent: Path,
    name: str,
    version: int,
    model: nn.Module,
    model_dir: Path,
    meta: dict[str, Any] | None = None,
    keep_last: int | None = None,
    prefix: str = "v",
) -> Path | None:
    """Publish an HF folder PARENT/NAME (collective: every rank writes its own shards).

    Rank 0 creates `model.safetensors` at its final size with the header; then each rank
    `pwrite`s the rows of every parameter it holds at their offsets and fsyncs, so no
    weight crosses between ranks. Rank 0 combines the pieces' CRC-32s into the file's,
    adds config and tokenizer, the manifest, and renames the entry into place (handoff
    protocol). This needs a filesystem where writes from several processes to disjoint
    ranges of one file are safe: local disks, NFS, Lustre and GPFS all are.
    """
    from areal_cli.rundir.layout import model_files_to_copy
    from areal_cli.rundir.safetensors_io import PieceWriter

    meta = {**(meta or {}), "publish_started": time.time()}
    rank = dist.get_rank()
    plan = _export_plan(model)
    file_name = "model.safetensors"
    tmp, header_piece = None, None
    if rank == 0:
        wait_for_cleanup()
        if parent not in _swept:  # leftovers only come from an earlier, crashed process
            handoff.remove_stale(parent)
            _swept.add(parent)
        tmp = handoff.new_tmp_dir(parent, name)
        header_piece = PieceWriter.create(tmp / file_name, plan.header, plan.size)
    tmp = Path(_broadcast_object(str(tmp) if tmp else None))  # also: the file now exists
    writer = PieceWriter(tmp / file_name)
    links = []
    try:
        with torch.no_grad():
            # collective: every rank walks the same order (full_tensor() gathers)
            for tensor, how, offset in plan.writes:
                if how == _FULL:
                    full = tensor.full_tensor()
                    if rank == 0:
                        writer.write(offset, full)
                elif how != _NONE:
                    writer.write(offset, tensor)
        if rank == 0:  # meanwhile the kernel is writing the shards out
            links = [handoff.link_or_copy(src, tmp) for src in model_files_to_copy(model_dir)]
    finally:
        pieces = writer.close()
    gathered: list[Any] = [pieces]
    if dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, pieces)
    path = None
    if rank == 0:
        all_pieces = [header_piece, *(p for rank_pieces in gathered for p in rank_pieces)]
        records = [handoff.combine_pieces(file_name, plan.size, all_pieces), *links]
        path = handoff.finish_entry(tmp, parent / name, version, records, meta).path
        if keep_last:
            _collect_in_background(parent, prefix, keep_last)
    if dist.get_world_size() > 1:
        dist.barrier()
    return path
