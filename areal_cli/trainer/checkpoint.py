"""Recover checkpoints (DCP) and Hugging Face exports, both as handoff entries.

Recover: `RUN/recover/step-N/` holds a DCP checkpoint of the sharded model and optimizer
(under `dcp/`), plus `state.json` (step, scheduler, loop state) and one `rng-rankR.pt`
per rank. Every rank writes its DCP shard into the entry's temp directory; after a
barrier rank 0 records the files, writes the manifest and renames (see handoff). DCP
reshards on load, so a checkpoint from 2 ranks resumes on 1.

Export: `RUN/weights/vN/` (and `RUN/checkpoints/`) hold a plain HF folder: config,
tokenizer files and `model.safetensors`, gathered on rank 0.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from areal_cli.weights import handoff

RECOVER_PREFIX = "step-"


def _broadcast_object(obj: Any) -> Any:
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
    import json

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


def _owners(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], world: int) -> dict[str, int]:
    """Which rank gathers and writes each tensor: largest first, onto the lightest rank."""
    load = [0] * world
    owners = {}
    for name, dtype, shape in sorted(
        specs, key=lambda s: -torch.Size(s[2]).numel() * torch.empty((), dtype=s[1]).element_size()
    ):
        rank = min(range(world), key=lambda r: load[r])
        owners[name] = rank
        load[rank] += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return owners


def _gather_to(value: torch.Tensor, owner: int) -> torch.Tensor | None:
    """The full tensor on rank `owner` (None elsewhere), from FSDP2's dim-0 shards.

    A gather to one rank moves 1/world of the data an all-gather does; ranks gather the
    tensors they own in parallel, so exporting costs about the model size over world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if not hasattr(value, "to_local"):
        return value if rank == owner else None
    placement = value.placements[0]
    if not (placement.is_shard() and placement.dim == 0):
        full = value.full_tensor()
        return full if rank == owner else None
    rows = value.shape[0]
    chunk = -(-rows // world)
    local = value.to_local().detach()
    padded = local.new_zeros((chunk, *value.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)] if rank == owner else None
    dist.gather(padded, parts, dst=owner)
    return torch.cat(parts)[:rows] if rank == owner else None


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
    """Publish an HF folder PARENT/NAME (collective; every rank writes a shard).

    Each tensor is gathered only to the rank that owns it, and each rank streams its own
    safetensors shard into the entry's temp directory (a writer thread overlaps gathering
    and writing). Rank 0 adds the shard index, config and tokenizer, the manifest, and
    renames the entry into place (handoff protocol).
    """
    from areal_cli.trainer.parallelize import model_files_to_copy
    from areal_cli.weights.safetensors_io import StreamingWriter

    meta = {**(meta or {}), "publish_started": time.time()}
    rank, world = dist.get_rank(), dist.get_world_size()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    items = [(k, v) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")]
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in items]
    owners = _owners(specs, world)
    files = (
        ["model.safetensors"]
        if world == 1
        else [f"model-{r + 1:05d}-of-{world:05d}.safetensors" for r in range(world)]
    )
    tmp = None
    if rank == 0:
        handoff.remove_stale(parent)
        tmp = handoff.new_tmp_dir(parent, name)
    tmp = Path(_broadcast_object(str(tmp) if tmp else None))
    writer = StreamingWriter(tmp, files[rank], [s for s in specs if owners[s[0]] == rank])
    try:
        for key, value in items:  # collective: every rank walks the same order
            full = _gather_to(value, owners[key])
            if full is not None:
                writer.put(full)
    finally:
        record = writer.close()
    records = [None] * world
    dist.all_gather_object(records, record)
    path = None
    if rank == 0:
        if world > 1:
            index = {
                "metadata": {"total_size": sum(r.size for r in records)},
                "weight_map": {k: files[owners[k]] for k, _, _ in specs},
            }
            records.append(
                handoff.write_bytes(
                    tmp, "model.safetensors.index.json", json.dumps(index, indent=1).encode()
                )
            )
        records += [handoff.link_or_copy(src, tmp) for src in model_files_to_copy(model_dir)]
        path = handoff.finish_entry(tmp, parent / name, version, records, meta).path
        if keep_last:
            handoff.gc(parent, prefix, keep_last)
    dist.barrier()
    return path
