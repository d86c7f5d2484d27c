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

import os
import shutil
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
        files = handoff.record_tree(tmp)
        manifest = {
            "name": final.name,
            "version": step,
            "meta": meta,
            "files": [vars(f) for f in files],
        }
        handoff.write_json_atomic(tmp / handoff.MANIFEST, manifest)
        handoff.fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        handoff.fsync_dir(parent)
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


def _gathered_tensors(model: nn.Module, skip: set[str]):
    """(name, full tensor) pairs of the model's state dict, gathered one at a time."""
    for name, value in model.state_dict().items():
        if name in skip:
            continue
        yield name, value.full_tensor() if hasattr(value, "full_tensor") else value


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
    """Publish an HF folder PARENT/NAME (collective; rank 0 writes).

    Tensors are gathered one by one and streamed into `model.safetensors` by a writer
    thread, so gathering overlaps the disk write and no full copy of the model is held.
    """
    from areal_cli.trainer.parallelize import model_files_to_copy
    from areal_cli.weights.safetensors_io import StreamingWriter

    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    skip = {"lm_head.weight"} if tied else set()
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in model.state_dict().items() if k not in skip]
    is_writer = dist.get_rank() == 0

    def write(directory: Path) -> list[handoff.FileRecord]:
        writer = StreamingWriter(directory, "model.safetensors", specs) if is_writer else None
        try:
            for _, tensor in _gathered_tensors(model, skip):  # collective: every rank iterates
                if writer is not None:
                    writer.put(tensor)
        finally:
            record = writer.close() if writer is not None else None
        if not is_writer:
            return []
        return [record] + [
            handoff.link_or_copy(src, directory) for src in model_files_to_copy(model_dir)
        ]

    path = None
    if is_writer:
        handoff.remove_stale(parent)
        path = handoff.write_entry(parent, name, version, write, meta).path
        if keep_last:
            handoff.gc(parent, prefix, keep_last)
    else:
        write(Path())
    dist.barrier()
    return path
