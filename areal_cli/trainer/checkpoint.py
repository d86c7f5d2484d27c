"""Recover checkpoints (DCP) and Hugging Face exports, both as handoff entries.

Recover: `RUN/recover/step-K/` (the state after K steps, counted from 1) holds a DCP checkpoint of the sharded model and optimizer
(under `dcp/`), plus `state.json` (step, scheduler, loop state) and one `rng-rankR.pt`
per rank. Every rank writes its DCP shard into the entry's temp directory; after a
barrier rank 0 records the files, writes the manifest and renames (see handoff). DCP
reshards on load, so a checkpoint from 2 ranks resumes on 1.

Export: `RUN/weights/vN/` (and `RUN/checkpoints/`) hold a plain HF folder: config,
tokenizer files and one `model.safetensors`, which every rank writes its shards into.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import math
import time
import uuid
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from areal_cli.models.lora import LoraSpec
from areal_cli.rundir import handoff
from areal_cli.rundir.paths import STEP_PREFIX, step_name
from areal_cli.trainer import collectives


def _alone() -> bool:
    """One trainer rank: DCP then skips its collectives. Not only for speed of the save:
    DCP's object all-gather of plans runs a large copy on a gloo worker thread, which
    gives that thread its own OpenMP team; libgomp then counts more threads than CPUs and
    every later parallel op of the trainer sleeps and wakes its workers instead of
    spinning (measured: a 1-rank SFT step 0.10 s before the first recover save, 0.30 s
    after it, with 200x the context switches). With several ranks the gather is needed;
    see the issue note."""
    return collectives.world_size() == 1


@contextlib.contextmanager
def _quiet_alone() -> Iterator[None]:
    """DCP warns at every 1-rank save and load that it assumes a single process, which is
    what `_alone` asks for on purpose: the warning would only fill the trainer's log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_recover(
    parent: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int,
    extra: dict[str, tuple[nn.Module, torch.optim.Optimizer]] | None = None,
) -> Path:
    """Write recover entry `step-N` collectively (every rank calls this). `extra` models
    (the PPO critic) go into the same DCP checkpoint under their own names (`NAME.*`,
    `NAME_optim.*`), so one entry restores every model of the run at the same step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = collectives.rank()
    tmp_name = collectives.broadcast_object(
        f".tmp-step-{step}-{uuid.uuid4().hex[:8]}" if rank == 0 else None
    )
    tmp = parent / tmp_name
    if rank == 0:
        parent.mkdir(parents=True, exist_ok=True)
        handoff.remove_stale(parent)
        tmp.mkdir()
    collectives.barrier()
    everything = {}
    for name, (m, o) in {"model": (model, optimizer), **(extra or {})}.items():
        everything[name], everything[_optim_key(name)] = get_state_dict(m, o, options=_options(m))
    with _quiet_alone():
        dcp.save(everything, checkpoint_id=str(tmp / "dcp"), no_dist=_alone())
    torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
    collectives.barrier()
    final = parent / step_name(step)
    if rank == 0:
        handoff.write_json_atomic(tmp / "state.json", state)
        meta = {"step": step, "world_size": collectives.world_size()}
        handoff.finish_entry(tmp, final, step, handoff.record_tree(tmp), meta)
        handoff.gc(parent, STEP_PREFIX, keep_last)
    collectives.barrier()
    return final


def load_recover(
    entry: handoff.Entry,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, tuple[nn.Module, torch.optim.Optimizer]] | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer, the `extra` models (see save_recover) and (same world
    size) RNG; returns state.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    stored = FileSystemReader(str(entry.path / "dcp")).read_metadata().state_dict_metadata
    has_optim = any(k.startswith("optim.") for k in stored)  # converted HF weights have none
    models = {"model": (model, optimizer), **(extra or {})}
    for name in models:
        if name != "model" and not any(k.startswith(f"{name}.") for k in stored):
            raise ValueError(f"{entry.path} holds no {name} (it was saved by another algorithm)")
    target = {}
    for name, (m, o) in models.items():
        target[name], optim_sd = get_state_dict(m, o, options=_options(m))
        if has_optim:
            target[_optim_key(name)] = optim_sd
    with _quiet_alone():
        dcp.load(target, checkpoint_id=str(entry.path / "dcp"), no_dist=_alone())
    for name, (m, o) in models.items():
        if has_optim:
            set_state_dict(
                m,
                o,
                model_state_dict=target[name],
                optim_state_dict=target[_optim_key(name)],
                options=_options(m),
            )
        else:
            set_model_state_dict(m, target[name], options=_options(m))
    rng_file = entry.path / f"rng-rank{collectives.rank()}.pt"
    if entry.meta.get("world_size") == collectives.world_size() and rng_file.exists():
        _set_rng_state(load_rng_file(rng_file))
    return json.loads((entry.path / "state.json").read_text())


def _options(model: nn.Module) -> Any:
    """How a model's state goes into a recover entry: whole; or, when some parameters are
    frozen (a LoRA run's base), the trained ones only, since the frozen ones are rebuilt
    from the base model at every start (a LoRA entry holds the adapters, not the model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if all(p.requires_grad for p in model.parameters()):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _optim_key(name: str) -> str:
    """Where a model's optimizer state sits in the DCP checkpoint: `optim` for the actor
    (the key older entries have), `NAME_optim` for an extra model."""
    return "optim" if name == "model" else f"{name}_optim"


def load_rng_file(path: Path) -> dict[str, torch.Tensor]:
    """A rank's saved RNG state: tensors only (`weights_only=True`), so a recover entry
    cannot run code when it is loaded."""
    return torch.load(path, weights_only=True)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# How `export_hf` writes one piece: bytes this rank holds, at their offset in the file;
# or the gathered `full_tensor()` (collective; rank 0 writes), for layouts that hold no
# block of their own (a Partial placement).
_RUN, _FULL = "run", "full"


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


def _runs(
    local: torch.Tensor, shape: tuple, offset: tuple, full: tuple
) -> list[tuple[int, torch.Tensor]]:
    """The contiguous pieces of a block `local` (of `shape`, at element `offset` of a
    row-major tensor of shape `full`): (element offset in the full tensor, 1-D view).
    A block of whole rows is one piece; a block of some columns is one piece per row."""
    if math.prod(shape) == 0:
        return []
    flat = local.reshape(-1)
    partial = [d for d in range(len(shape)) if shape[d] != full[d]]
    if not partial:
        return [(0, flat)]
    j = partial[-1]  # dims after j are whole, so one run spans dims j..
    strides = [math.prod(full[d + 1 :]) for d in range(len(full))]
    local_strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    length = shape[j] * local_strides[j]
    runs = []
    for index in itertools.product(*(range(n) for n in shape[:j])):
        start = sum((offset[d] + index[d]) * strides[d] for d in range(j))
        start += offset[j] * strides[j]
        at = sum(index[d] * local_strides[d] for d in range(j))
        runs.append((start, flat[at : at + length]))
    return runs


def _build_plan(model: nn.Module, fingerprint: tuple) -> _ExportPlan:
    """Each rank writes the block of every parameter it holds straight into the exported
    file, whatever the layout: FSDP2 rows (Shard(0), even uneven), tensor-parallel
    columns or rows, or both at once. Of the copies of a block, only the primary one is
    written (`step.is_primary_block`), so the blocks tile every tensor once; plain
    tensors are written whole by rank 0. The choice depends on meshes and placements
    only, which every rank sees alike, so every rank walks the same collectives."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from areal_cli.rundir.safetensors_io import layout, tensor_bytes
    from areal_cli.trainer.step import is_primary_block

    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    items = [(k, v) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")]
    header, starts, size = layout(tuple((k, v.dtype, tuple(v.shape)) for k, v in items))
    writes: list[tuple[torch.Tensor | memoryview, str, int]] = []
    for name, value in items:
        placements = tuple(getattr(value, "placements", ()))
        if any(p.is_partial() for p in placements):
            writes.append((value, _FULL, starts[name]))
            continue
        if not is_primary_block(value):
            continue  # another rank writes the same block
        if not placements:
            runs = [(0, value.reshape(-1))]
        else:
            mesh = value.device_mesh
            shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
            runs = _runs(value.to_local(), tuple(shape), tuple(offset), tuple(value.shape))
        for at, run in runs:
            source: torch.Tensor | memoryview = run
            if run.device.type == "cpu" and run.is_contiguous():
                source = tensor_bytes(run)  # a view of the parameter's memory: reused every step
            writes.append((source, _RUN, starts[name] + at * value.element_size()))
    return _ExportPlan(fingerprint, header, size, tuple(writes))


class Checkpointer:
    """Writes the trainer's HF exports, keeping what one process learns across them: the
    export plan of each model (`_ExportPlan`), the parents whose crash leftovers it already
    removed, and the background collection of old entries (one at a time)."""

    def __init__(self) -> None:
        self._plans: weakref.WeakKeyDictionary[nn.Module, _ExportPlan] = weakref.WeakKeyDictionary()
        self._swept: set[Path] = set()  # parents whose crash leftovers are removed
        self._cleaner: concurrent.futures.ThreadPoolExecutor | None = None
        self._cleaning: concurrent.futures.Future | None = None

    def _export_plan(self, model: nn.Module) -> _ExportPlan:
        fingerprint = _fingerprint(model)
        plan = self._plans.get(model)
        if plan is None or plan.fingerprint != fingerprint:
            plan = self._plans[model] = _build_plan(model, fingerprint)
        return plan

    def drop_plans(self) -> None:
        """Forget every export plan. On a GPU a plan holds views of the parameters' device
        memory, which would keep it allocated after the parameters move to host memory
        (trainer.offload); the next export plans again."""
        self._plans.clear()

    def _collect_in_background(self, parent: Path, prefix: str, keep_last: int) -> None:
        """Delete old entries while the next step trains: unlinking a few hundred MB takes
        longer than the whole rest of a publish, and nothing needs to wait for it."""
        self.wait_for_cleanup()
        self._cleaner = self._cleaner or concurrent.futures.ThreadPoolExecutor(1, "areal-gc")
        self._cleaning = self._cleaner.submit(handoff.gc, parent, prefix, keep_last)

    def wait_for_cleanup(self) -> None:
        """Finish the pending background collection; re-raises its error, if any."""
        if self._cleaning is not None:
            pending, self._cleaning = self._cleaning, None
            pending.result()

    def export_hf(
        self,
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
        rank = collectives.rank()
        plan = self._export_plan(model)
        file_name = "model.safetensors"
        tmp, header_piece = None, None
        if rank == 0:
            tmp = self._start_entry(parent, name)
            header_piece = PieceWriter.create(tmp / file_name, plan.header, plan.size)
        tmp = Path(
            collectives.broadcast_object(str(tmp) if tmp else None)
        )  # also: the file now exists
        writer = PieceWriter(tmp / file_name)
        links = []
        try:
            with torch.no_grad():
                # collective: every rank walks the same order (full_tensor() gathers)
                for tensor, how, offset in plan.writes:
                    if how == _FULL:
                        full = collectives.full_tensor(tensor)
                        if rank == 0:
                            writer.write(offset, full)
                    else:
                        writer.write(offset, tensor)
            if rank == 0:  # meanwhile the kernel is writing the shards out
                links = [handoff.link_or_copy(src, tmp) for src in model_files_to_copy(model_dir)]
        finally:
            pieces = writer.close()
        gathered = collectives.all_gather_object(pieces)
        path = None
        if rank == 0:
            all_pieces = [header_piece, *(p for rank_pieces in gathered for p in rank_pieces)]
            records = [handoff.combine_pieces(file_name, plan.size, all_pieces), *links]
            path = self._finish_entry(tmp, parent, name, version, records, meta, keep_last, prefix)
        collectives.barrier()
        return path

    def _start_entry(self, parent: Path, name: str) -> Path:
        """Rank 0: the temp folder of entry PARENT/NAME, once the previous collection is
        done and (the first time for `parent`) a crashed process's leftovers are gone."""
        self.wait_for_cleanup()
        if parent not in self._swept:  # leftovers only come from an earlier, crashed process
            handoff.remove_stale(parent)
            self._swept.add(parent)
        return handoff.new_tmp_dir(parent, name)

    def _finish_entry(
        self,
        tmp: Path,
        parent: Path,
        name: str,
        version: int,
        records: list,
        meta: dict[str, Any],
        keep_last: int | None,
        prefix: str,
    ) -> Path:
        """Rank 0: manifest and rename of the entry (handoff), then old entries collected
        in the background."""
        path = handoff.finish_entry(tmp, parent / name, version, records, meta).path
        if keep_last:
            self._collect_in_background(parent, prefix, keep_last)
        return path

    def export_adapter(
        self,
        parent: Path,
        name: str,
        version: int,
        model: nn.Module,
        spec: LoraSpec,
        model_dir: Path,
        meta: dict[str, Any] | None = None,
        keep_last: int | None = None,
        prefix: str = "v",
    ) -> Path | None:
        """Publish a LoRA run's adapters as PARENT/NAME in PEFT's layout (collective):
        `adapter_config.json` (its base model: `model_dir`) and `adapter_model.safetensors`,
        with the base model's tokenizer files, as one handoff entry. The adapters are
        small, so every rank gathers each one whole and rank 0 writes them."""
        from areal_cli.models.lora import adapter_state, write_adapter
        from areal_cli.rundir.layout import model_files_to_copy

        meta = {**(meta or {}), "publish_started": time.time(), "lora": True}
        rank = collectives.rank()
        with torch.no_grad():  # every rank walks the same keys: full_tensor() gathers
            tensors = {k: collectives.full_tensor(v) for k, v in adapter_state(model).items()}
        path = None
        if rank == 0:
            tmp = self._start_entry(parent, name)
            base = str(model_dir.resolve())
            records = write_adapter(tmp, {k: v.cpu() for k, v in tensors.items()}, spec, base)
            records += [
                handoff.link_or_copy(src, tmp)
                for src in model_files_to_copy(model_dir)
                if src.name != "config.json"  # a model's config would make it look whole
            ]
            meta["base_model"] = base
            path = self._finish_entry(tmp, parent, name, version, records, meta, keep_last, prefix)
        collectives.barrier()
        return path
