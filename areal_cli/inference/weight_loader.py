"""Weight loading for the engine: read a weights folder into reused buffers, check it
against the model, swap it in, and read new versions ahead while decoding goes on.

`WeightLoader` owns the staging buffers. A folder's safetensors files are read into the
staging buffers (reused between updates), matched against the model's tensors by name,
shape and kind, and swapped in: on the CPU the model then runs on that memory and the
buffers it ran on become the next staging. Read-ahead does the read early, on another
thread, and remembers the files' identity (inode, size, mtime), so the update that comes
for the same, unchanged files only swaps.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from areal_cli.inference.packed import PackedLinears
from areal_cli.inference.threads import one_core
from areal_cli.models.lora import (
    Adapter,
    AdapterError,
    LoraSpec,
    is_adapter_key,
    merge_into,
    read_adapter,
)
from areal_cli.rundir.layout import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_problem,
    is_adapter_folder,
)

logger = logging.getLogger("areal_cli.inference.engine")


class WeightLoadError(Exception):
    """A weight folder that cannot replace the running weights."""


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, honouring a shard index."""
    try:
        names = os.listdir(folder)  # one call: this runs on the critical path of every update
    except OSError:
        raise WeightLoadError(f"model path {folder} does not exist or is not a directory") from None
    index = folder / "model.safetensors.index.json"
    if index.name in names:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise WeightLoadError(f"unreadable shard index {index}: {exc}") from exc
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise WeightLoadError(f"{folder} is incomplete: missing shard(s) {_names(missing)}")
        return [folder / s for s in shards]
    files = sorted(folder / n for n in names if n.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weights in {folder}")
    return files


def read_safetensors(files: list[Path], buffers: list[bytearray]) -> dict[str, torch.Tensor]:
    """Read every tensor of the given files to CPU; corrupt or truncated files raise.

    The tensors are views of `buffers` (one per file, reused between calls and updated in
    place), so the caller must be done with them before the next call."""
    from areal_cli.rundir.safetensors_io import read_tensors

    tensors: dict[str, torch.Tensor] = {}
    for i, path in enumerate(files):
        try:
            loaded, buffer = read_tensors(path, buffers[i] if i < len(buffers) else None)
        except (OSError, ValueError) as exc:
            raise WeightLoadError(f"cannot read {path}: {exc}") from exc
        buffers[i : i + 1] = [buffer]
        for name, tensor in loaded.items():
            if name in tensors:
                raise WeightLoadError(f"tensor {name} appears in more than one file")
            tensors[name] = tensor
    return tensors


def file_identity(files: list[Path]) -> tuple:
    """What tells one version of a weights folder from another: its files' inodes, sizes
    and modification times (handoff entries are never modified once renamed in)."""
    identity = []
    for path in files:
        try:
            st = path.stat()
        except OSError as exc:
            raise WeightLoadError(f"cannot read {path}: {exc}") from exc
        identity.append((path.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(identity)


class ReadAhead(NamedTuple):
    """Weights read and validated before anyone asked for them (in the staging buffers)."""

    folder: Path
    identity: tuple
    tensors: dict[str, torch.Tensor]


def _names(names: Iterable[str], limit: int = 5) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class WeightTable:
    """The model's tensors by checkpoint name; tied tensors accept any of their names."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.live: dict[str, torch.Tensor] = {}
        self.alias: dict[str, str] = {}
        first_name: dict[int, str] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            canonical = first_name.setdefault(id(tensor), name)
            self.alias[name] = canonical
            self.live.setdefault(canonical, tensor)
        # what each live tensor is when it holds weights (it holds none while released)
        self.specs = {n: (t.shape, t.dtype, t.device) for n, t in self.live.items()}

    def match(self, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map checkpoint tensors onto live tensors (cast, on device), or raise WeightLoadError."""
        unexpected = sorted(n for n in loaded if n not in self.alias)
        found = {self.alias[n]: t for n, t in loaded.items() if n in self.alias}
        missing = sorted(n for n in self.live if n not in found)
        wrong = [
            f"{n}: checkpoint {list(t.shape)} {t.dtype} vs model {list(shape)} {dtype}"
            for n, t in sorted(found.items())
            if t.shape != (shape := self.specs[n][0])
            or t.is_floating_point() != (dtype := self.specs[n][1]).is_floating_point
        ]
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing tensor(s): {_names(missing)}")
        if wrong:
            problems.append(f"{len(wrong)} shape/dtype mismatch(es): {_names(wrong, 3)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected tensor(s): {_names(unexpected)}")
        if problems:
            raise WeightLoadError("; ".join(problems))
        return {n: t.to(device=self.specs[n][2], dtype=self.specs[n][1]) for n, t in found.items()}

    @torch.no_grad()
    def swap_in(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Make `tensors` the live weights. On the CPU the live tensors just take over their
        memory (no copy); accelerator weights are copied into, so their memory stays put.
        Returns whether the live weights now alias `tensors`' memory."""
        aliased = False
        for name, tensor in tensors.items():
            live = self.live[name]
            if live.device.type == "cpu":
                live.data = tensor  # same Parameter object: tied modules follow
                aliased = True
            else:
                live.copy_(tensor)
        return aliased

    @torch.no_grad()
    def release(self) -> None:
        """Give the weights' memory back: CPU tensors are dropped (the next load refills
        them), accelerator ones move to host memory (`restore` brings them back)."""
        for live in self.live.values():
            if live.device.type == "cpu":
                live.data = torch.empty(0, dtype=live.dtype)
            else:
                live.data = live.data.to("cpu")

    @torch.no_grad()
    def restore(self) -> bool:
        """After `release`: accelerator weights back on their device. Returns whether the
        live tensors hold weights again (dropped CPU weights wait for a load)."""
        for name, live in self.live.items():
            device = self.specs[name][2]
            if device.type != "cpu":
                live.data = live.data.to(device)
        return all(live.shape == self.specs[name][0] for name, live in self.live.items())


class WeightLoader:
    """The staging buffers, the model's weight table and what was read ahead.

    `load` and `swap_in` run on the scheduler thread with `lock` held; `read_ahead` takes
    the lock itself, from any thread. The lock covers the staging and serving buffers and
    the read-ahead result."""

    def __init__(self, model: torch.nn.Module, device: torch.device, base: Path) -> None:
        self.table = WeightTable(model)
        self.packed = PackedLinears(model)  # CPU bf16/fp16: prepared again at every swap
        self.device = device
        self.base = base  # the model folder a LoRA adapter's folder is merged into
        self.lock = threading.Lock()
        self.served_identity: tuple = ()  # of the files last swapped in
        self._staging: list[bytearray] = []
        self._serving: list[bytearray] = []
        self._ahead: ReadAhead | None = None
        self.released = False  # the memory is given back (colocated, while the trainer steps)
        self.empty = False  # the live tensors hold no weights: the next load must fill them

    @property
    def ahead_folder(self) -> Path | None:
        """The folder whose weights are read ahead and waiting for their update, if any."""
        ahead = self._ahead
        return ahead.folder if ahead is not None else None

    def read_ahead(self, folder: Path) -> bool:
        """Read and validate `folder` now, on the calling thread (CPU only: an accelerator
        would need a second copy of the weights in its memory). Returns whether its
        weights are ready; a folder that cannot be loaded is left for the update to refuse."""
        if self.device.type != "cpu":
            return False
        with self.lock:
            if self.released:  # reading would take back the memory given to the trainer
                return False
            try:
                files = self._files(folder)
                identity = file_identity(files)
                if identity == self.served_identity:  # its update came first
                    return True
                self._ahead = None
                tensors = self._read(folder)
            except WeightLoadError as exc:
                logger.debug("not read ahead: %s: %s", folder, exc)
                return False
            self._ahead = ReadAhead(folder, identity, tensors)
        return True

    def load(self, path: Path) -> tuple[dict[str, torch.Tensor], tuple, bool]:
        """Validated tensors of `path` in the staging buffers, the files' identity, and
        whether they had been read ahead. Hold `lock`."""
        identity = file_identity(self._files(path))
        ahead, self._ahead = self._ahead, None  # staging gets reused either way
        if ahead is not None and ahead.identity == identity:
            return ahead.tensors, identity, True
        return self._read(path), identity, False

    def _files(self, folder: Path) -> list[Path]:
        """The files whose identity tells a version of `folder` apart: its safetensors, or
        for a LoRA adapter folder its two files and the base model's safetensors."""
        if is_adapter_folder(folder):
            return [
                *safetensors_files(self.base),
                folder / ADAPTER_CONFIG,
                folder / ADAPTER_WEIGHTS,
            ]
        return safetensors_files(folder)

    def _read(self, folder: Path) -> dict[str, torch.Tensor]:
        """Read `folder` into the staging buffers and check it against the model; a LoRA
        adapter folder (PEFT's layout) is checked and merged in (`_merged`)."""
        if not is_adapter_folder(folder):
            return self.table.match(read_safetensors(safetensors_files(folder), self._staging))
        if problem := adapter_problem(folder):
            raise WeightLoadError(problem)
        try:
            return self._merged(read_adapter(folder))
        except AdapterError as exc:
            raise WeightLoadError(str(exc)) from exc

    def _merged(self, adapter: Adapter) -> dict[str, torch.Tensor]:
        """The base model's weights, read again from `base` into the staging buffers (from
        the page cache), with `adapter` merged in, checked against the model: merges never
        accumulate rounding, and the result is exactly what `convert-checkpoint
        --merge-lora` writes. Merged in, an adapter costs decoding nothing (one is served
        at a time). Raises AdapterError."""
        base = read_safetensors(safetensors_files(self.base), self._staging)
        return self.table.match(merge_into(base, adapter))

    def swap_in(self, tensors: dict[str, torch.Tensor], identity: tuple) -> None:
        """Make `tensors` (from `load`) the live weights. Hold `lock`."""
        if self.table.swap_in(tensors):
            self._staging, self._serving = self._serving, self._staging
        self.served_identity = identity
        self.empty = False
        self.packed.refresh()

    def release(self) -> None:
        """Give back the weights' memory and every buffer (see WeightTable.release). Hold
        `lock`."""
        self.table.release()
        self.packed.drop()
        self._staging, self._serving, self._ahead = [], [], None
        self.served_identity = ()
        self.released = True
        self.empty = self.device.type == "cpu"

    def restore(self) -> None:
        """Undo `release` (dropped CPU weights come back with the next load). Hold `lock`."""
        self.empty = not self.table.restore()
        self.released = False
        if not self.empty:
            self.packed.refresh()

    def swap_in_received(self, received: dict[str, torch.Tensor]) -> None:
        """Make a whole version received over the weight-update group the live weights
        (checked as a folder is; raises WeightLoadError). They are their own memory, not
        the staging buffers', so the buffers the model ran on are free for the next read
        from disk. A LoRA run sends its adapters only (every name ends in lora_A or
        lora_B, and B comes times its scale: trainer.weight_sender): they are merged into
        the base weights, read from `base` as for an adapter folder. Hold `lock`."""
        self._ahead = None
        if received and all(is_adapter_key(k) for k in received):
            tensors = {k: v.float().cpu() for k, v in received.items()}
            rank = next(v.shape[0] for k, v in tensors.items() if k.endswith(".lora_A"))
            modules = tuple(sorted({k.rsplit(".", 1)[0] for k in tensors}))
            spec = LoraSpec(rank, float(rank), modules)  # scale 1: B came scaled
            try:
                self.swap_in(self._merged(Adapter(spec, str(self.base), tensors)), ())
            except AdapterError as exc:
                raise WeightLoadError(str(exc)) from exc
            return
        self.table.swap_in(self.table.match(received))
        self.served_identity = ()
        self.empty = False
        self.packed.refresh()

    def watch(
        self, directory: Path, prefix: str, poll_s: float, stopping: Callable[[], bool]
    ) -> None:
        """Read ahead, on a background thread, every handoff entry renamed into `directory`
        from now on, until `stopping()`."""
        thread = threading.Thread(
            target=self._watch_loop,
            args=(directory, prefix, poll_s, stopping),
            name="areal-read-ahead",
            daemon=True,
        )
        thread.start()

    def _watch_loop(
        self, directory: Path, prefix: str, poll_s: float, stopping: Callable[[], bool]
    ) -> None:
        from areal_cli.rundir import handoff

        one_core()  # the scheduler's kernels keep their spinning workers (threads.py)
        watcher = handoff.Watcher(directory)  # before the first look: no rename is missed
        try:
            newest = handoff.latest(directory, prefix)  # already there: not worth reading
            seen = newest.version if newest is not None else -1
            while not stopping():
                entry = handoff.newest_after(directory, prefix, seen)
                if entry is None:
                    watcher.wait(poll_s)
                    continue
                seen = entry.version
                self.read_ahead(entry.path)
        except Exception:  # never take the server down: updates just read on request
            logger.exception("weights read-ahead of %s stopped", directory)
        finally:
            watcher.close()
