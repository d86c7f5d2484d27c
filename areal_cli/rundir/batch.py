"""The trainer's input: one rollout batch per step, stored as a handoff entry.

`RUN/rollouts/step-N/` holds `batch.safetensors` with packed 1-D tensors plus a manifest
(see areal_cli.rundir.handoff for the write/read protocol). Sequences are stored in
group order: `group_size` consecutive sequences share one prompt.

Per token (length T = sum of seqlens), token-aligned like the losses module:
  input_ids   int64   prompt and completion tokens of every sequence, concatenated
  loss_mask   int8    1 on generated tokens that are trained, 0 on prompt tokens
  logprobs    float32 behaviour logprob of each generated token (0 elsewhere)
  versions    int32   weight version that generated each token (-1 on prompt tokens)
Per sequence (length N):
  seqlens     int64   tokens per sequence
  rewards     float32 scalar reward of each sequence
  advantages  float32 optional; when present the trainer uses them instead of rewards
  truncated   bool    optional; the sequence stopped at max_new_tokens, with no EOS
  group_ids   int64   optional; the group (prompt) of each sequence, when groups differ in
                      size (an agent's episodes give a varying number of samples); absent,
                      the groups are `group_size` consecutive sequences
The manifest holds group_size and, when the controller wrote it, max_new_tokens: the
generation limit the batch was sampled under (the overlong penalty reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.rundir import handoff
from areal_cli.rundir.paths import step_name

if TYPE_CHECKING:
    import numpy as np
    import torch

BATCH_FILE = "batch.safetensors"
_TOKEN_KEYS = ("input_ids", "loss_mask", "logprobs", "versions")


@dataclass
class RolloutBatch:
    """A packed batch of sequences with their behaviour logprobs, versions and rewards."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    seqlens: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    advantages: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    max_new_tokens: int = 0  # 0: not recorded
    group_ids: torch.Tensor | None = None  # per sequence, when groups differ in size

    def __post_init__(self) -> None:
        total = int(self.seqlens.sum())
        for key in _TOKEN_KEYS:
            if getattr(self, key).shape != (total,):
                raise ValueError(
                    f"{key} has shape {tuple(getattr(self, key).shape)}, expected ({total},)"
                )
        if self.rewards.shape != self.seqlens.shape:
            raise ValueError("rewards must have one value per sequence")
        if self.group_ids is not None:
            if self.group_ids.shape != self.seqlens.shape:
                raise ValueError("group_ids must have one value per sequence")
        elif len(self.seqlens) % self.group_size:
            raise ValueError(
                f"{len(self.seqlens)} sequences do not form groups of {self.group_size}"
            )

    @property
    def groups(self) -> int | torch.Tensor:
        """The grouping advantages normalise over (areal_cli.trainer.advantages.Groups)."""
        return self.group_size if self.group_ids is None else self.group_ids

    @property
    def n_seqs(self) -> int:
        return len(self.seqlens)

    def offsets(self) -> list[int]:
        """Start of each sequence in the packed tensors, plus the total at the end."""
        return [0] + self.seqlens.cumsum(0).tolist()

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        """Token tensors of sequence i."""
        off = self.offsets()
        return {k: getattr(self, k)[off[i] : off[i + 1]] for k in _TOKEN_KEYS}

    @classmethod
    def from_sequences(
        cls,
        sequences: list[dict[str, torch.Tensor]],
        rewards: list[float],
        group_size: int,
        group_ids: list[int] | None = None,
    ) -> RolloutBatch:
        """Pack per-sequence dicts with the four token keys."""
        import torch

        return cls(
            **{k: torch.cat([s[k] for s in sequences]) for k in _TOKEN_KEYS},
            seqlens=torch.tensor([len(s["input_ids"]) for s in sequences], dtype=torch.int64),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            group_size=group_size,
            group_ids=None if group_ids is None else torch.tensor(group_ids, dtype=torch.int64),
        )


def write_batch(
    parent: Path, step: int, batch: RolloutBatch, meta: dict | None = None
) -> handoff.Entry:
    """Publish `batch` as PARENT/step-N (atomic; see handoff)."""
    import torch

    tensors = {
        "input_ids": batch.input_ids.to(torch.int64),
        "loss_mask": batch.loss_mask.to(torch.int8),
        "logprobs": batch.logprobs.to(torch.float32),
        "versions": batch.versions.to(torch.int32),
        "seqlens": batch.seqlens.to(torch.int64),
        "rewards": batch.rewards.to(torch.float32),
    }
    if batch.advantages is not None:
        tensors["advantages"] = batch.advantages.to(torch.float32)
    if batch.truncated is not None:
        tensors["truncated"] = batch.truncated.to(torch.bool)
    if batch.group_ids is not None:
        tensors["group_ids"] = batch.group_ids.to(torch.int64)
    columns = {k: v.contiguous().numpy() for k, v in tensors.items()}
    return write_columns(parent, step, columns, batch.group_size, meta, batch.max_new_tokens)


def write_columns(
    parent: Path,
    step: int,
    columns: dict[str, np.ndarray],
    group_size: int,
    meta: dict[str, Any] | None = None,
    max_new_tokens: int = 0,
) -> handoff.Entry:
    """Publish a batch given as numpy columns (the names and dtypes of the module
    docstring) as PARENT/step-N: the controller's path, which never imports torch (~1.9 s
    of CPU that lay between the first batch and the first step)."""
    from safetensors.numpy import save

    data = save(columns)
    info = {"group_size": group_size, "n_seqs": len(columns["seqlens"]), **(meta or {})}
    if max_new_tokens:
        info["max_new_tokens"] = max_new_tokens
    return handoff.write_entry(
        parent, step_name(step), step, lambda d: [handoff.write_bytes(d, BATCH_FILE, data)], info
    )


def read_batch(entry: handoff.Entry) -> RolloutBatch:
    """Load a batch entry written by `write_batch`."""
    from safetensors.torch import load_file

    t = load_file(str(entry.path / BATCH_FILE))
    return RolloutBatch(
        input_ids=t["input_ids"],
        loss_mask=t["loss_mask"],
        logprobs=t["logprobs"],
        versions=t["versions"],
        seqlens=t["seqlens"],
        rewards=t["rewards"],
        group_size=int(entry.meta["group_size"]),
        advantages=t.get("advantages"),
        truncated=t.get("truncated"),
        max_new_tokens=int(entry.meta.get("max_new_tokens", 0)),
        group_ids=t.get("group_ids"),
    )
