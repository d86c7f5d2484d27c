"""The allocation grammar: which backend runs on how many devices.

    allocation := component (('+' | '|') component)*
    component  := backend ':' dim+
    dim        := ('d' | 't' | 'p' | 'c') INT        each letter at most once

Examples: `sglang:d4t1+fsdp:d4`, `embedded:d1+fsdp:d2`, `sglang:d2t2`. Inference backends
are embedded, sglang and vllm; the training backend is fsdp. Inference `d` counts server
processes (replicas); `t`/`p` are GPUs inside one server. Trainer `d` counts FSDP ranks
and `t` the tensor-parallel ranks of each (`fsdp:d2t2` is 4 ranks).

`+` keeps the components apart, each on devices of its own; `|` (as in AReaL) puts them on
the same devices, colocated: `sglang:d1|fsdp:d1` is one GPU, `embedded:d1|fsdp:d1` every
core of a CPU machine. Colocated rollout and training take turns (synchronous RL; see
areal_cli.rollout.phases), so both sides must span the same number of devices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from areal_cli.config.errors import did_you_mean
from areal_cli.config.schema import ParallelStrategy

INFERENCE_BACKENDS = ("embedded", "sglang", "vllm")
TRAIN_BACKENDS = ("fsdp",)
_DIM_NAMES = {
    "d": "data_parallel_size",
    "t": "tensor_parallel_size",
    "p": "pipeline_parallel_size",
    "c": "context_parallel_size",
}
_COMPONENT = re.compile(r"^([a-z]+):((?:[a-z]\d+)+)$")


class AllocationError(ValueError):
    """A malformed or unsupported allocation string; `fix` says what to write instead."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.message = message
        self.fix = fix


@dataclass(frozen=True)
class AllocationMode:
    """A parsed allocation: each side's backend and ParallelStrategy (None if absent)."""

    inference_backend: str | None
    inference: ParallelStrategy | None
    train_backend: str | None
    train: ParallelStrategy | None
    colocated: bool = False  # '|': the two sides share their devices and take turns

    @property
    def n_servers(self) -> int:
        """Inference server processes (one per data-parallel replica)."""
        return self.inference.data_parallel_size if self.inference else 0


def _parse_dims(text: str, component: str) -> ParallelStrategy:
    sizes: dict[str, int] = {}
    for letter, number in re.findall(r"([a-z])(\d+)", text):
        if letter not in _DIM_NAMES:
            raise AllocationError(
                f"unknown dimension '{letter}' in '{component}'",
                "dimensions are d (data), t (tensor), p (pipeline) and c (context)",
            )
        if _DIM_NAMES[letter] in sizes:
            raise AllocationError(
                f"dimension '{letter}' given twice in '{component}'",
                "give each of d, t, p, c at most once",
            )
        if int(number) < 1:
            raise AllocationError(
                f"'{letter}{number}' in '{component}' must be at least 1",
                f"write {letter}1 or more",
            )
        sizes[_DIM_NAMES[letter]] = int(number)
    return ParallelStrategy(**sizes)


def parse_allocation(text: str) -> AllocationMode:
    """Parse an allocation string; raises AllocationError explaining what is wrong."""
    example = "write for example embedded:d1+fsdp:d2 or sglang:d4t1+fsdp:d4"
    if not text or not text.strip():
        raise AllocationError("allocation_mode is empty", example)
    found: dict[str, tuple[str, ParallelStrategy]] = {}
    text = text.replace(" ", "")
    if "+" in text and "|" in text:
        raise AllocationError(
            f"'{text}' mixes '+' and '|'",
            "join the inference and the trainer component with '+' (apart) or '|' (sharing devices)",
        )
    for component in re.split(r"[+|]", text):
        match = _COMPONENT.match(component)
        if not match:
            if ":" not in component:
                raise AllocationError(f"component '{component}' has no ':dims' part", example)
            raise AllocationError(
                f"cannot parse component '{component}'",
                "use backend:dims with dims like d2t1 (letters d/t/p/c, each followed by a number)",
            )
        backend, dims = match.groups()
        if backend in INFERENCE_BACKENDS:
            side = "inference"
        elif backend in TRAIN_BACKENDS:
            side = "train"
        else:
            raise AllocationError(
                f"unknown backend '{backend}'",
                did_you_mean(backend, INFERENCE_BACKENDS + TRAIN_BACKENDS),
            )
        if side in found:
            raise AllocationError(
                f"two {side} components ('{found[side][0]}' and '{backend}')",
                f"give one {side} component",
            )
        found[side] = (backend, _parse_dims(dims, component))
    inference = found.get("inference")
    train = found.get("train")
    mode = AllocationMode(
        inference_backend=inference[0] if inference else None,
        inference=inference[1] if inference else None,
        train_backend=train[0] if train else None,
        train=train[1] if train else None,
        colocated="|" in text,
    )
    _check_supported(mode)
    return mode


def _check_supported(mode: AllocationMode) -> None:
    """Reject layouts a backend cannot run, saying why."""
    if mode.colocated:
        _check_colocated(mode)
    train = mode.train
    if train is not None:
        if train.pipeline_parallel_size > 1:
            raise AllocationError(
                "fsdp cannot do pipeline parallelism (p>1): FSDP shards every layer across all ranks, it has no stages",
                "use fsdp:dN with N ranks",
            )
    inference = mode.inference
    if inference is None:
        return
    if mode.inference_backend == "embedded" and inference.per_replica_size > 1:
        raise AllocationError(
            "the embedded server runs one whole model per process; it has no t, p or c",
            "use embedded:dN for N servers",
        )
    if mode.inference_backend in ("sglang", "vllm") and inference.context_parallel_size > 1:
        raise AllocationError(
            f"{mode.inference_backend} context parallelism (c>1) is not supported by areal",
            f"use {mode.inference_backend}:dNtM",
        )


def _check_colocated(mode: AllocationMode) -> None:
    """'|' joins one inference and one trainer component of the same size."""
    if mode.inference is None or mode.train is None:
        raise AllocationError(
            "'|' shares devices between an inference and a trainer component, and one is missing",
            "write for example embedded:d1|fsdp:d1 or sglang:d1|fsdp:d1",
        )
    n_inference, n_train = mode.inference.world_size, mode.train.world_size
    if n_inference != n_train:
        raise AllocationError(
            f"components joined by '|' share their devices, so they need as many: "
            f"{mode.inference_backend} spans {n_inference} and fsdp {n_train}",
            f"give both {max(n_inference, n_train)} (e.g. "
            f"{mode.inference_backend}:d{max(n_inference, n_train)}|fsdp:d{max(n_inference, n_train)}), "
            "or keep them apart with '+'",
        )
