"""The trainer's per-step record: one line of RUN/logs/trainer-metrics.jsonl.

Rank 0 of the trainer appends one `TrainerStep` per finished step, before the step's
recover entry (a kill between the two loses the entry, never the line). The controller
reads the lines back as `TrainerStep`s: under RL it joins each with the step's rollout
figures (areal_cli.rollout), under a supervised role it relays it (areal_cli.launch.follow).
Both sides use this one type, and the names of the figures the controller carries into
RUN/metrics.jsonl are spelled once, here (`RL_FIGURES`, `SUPERVISED_FIGURES`).

A line is one flat JSON object (the fields below, then the figures), so older run
directories read back unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# RUN/metrics.jsonl holds one line per step and, with eval.freq_steps, eval rows marked
# {"kind": "eval"} beside them (areal_cli.rollout.evaluation); readers of steps skip them.
EVAL_KIND = "eval"


def is_eval_row(row: dict[str, Any]) -> bool:
    """A metrics.jsonl line that is an evaluation's row, not a step's."""
    return row.get("kind") == EVAL_KIND


# Figures of an RL step (algorithm: grpo, ppo) that metrics.jsonl carries.
RL_FIGURES = (
    "loss",
    "grad_norm",
    "clip_frac",
    "entropy",
    "imp_weight_mean",
    "imp_weight_max",
    "padding_fraction",
    "replanned_shards",
    "empty_micro_batches",
    "tokens",
    "kl",
    "dual_clip_frac",  # actor.c_clip
    "m2_drop_frac",  # actor.m2_threshold (M2PO)
    "rejected_frac",  # actor.rejection_sampling, action mask
    "clamped_frac",  # actor.rejection_sampling, action clamp
    "behave_approx_kl",  # mean log(prox / behav) over the tokens it kept
    "prox_loglinear_abs_err",  # actor.prox_logp_method: metrics
    "prox_linear_abs_err",
    "prox_rollout_abs_err",
    "distill_kl",  # teacher: the student's per-token reverse KL to the teacher
    # algorithm: ppo (the critic; areal_cli.trainer.critic)
    "value_loss",
    "value_clip_frac",
    "explained_variance",
    "value_mean",
    "return_mean",
    "critic_grad_norm",
)

# Figures of a supervised step (algorithm: sft, rm) that metrics.jsonl carries.
SUPERVISED_FIGURES = (
    "loss",
    "nll",
    "eval_loss",
    "eval_loss_initial",
    "accuracy",
    "margin",
    "chosen_score",
    "pairs",
    "logp_accuracy",  # algorithm: dpo
    "chosen_reward",
    "rejected_reward",
    "eval_margin",
    "eval_logp_accuracy",
    "eval_logp_accuracy_initial",
    "eval_accuracy",
    "eval_accuracy_initial",
    "grad_norm",
    "tokens",
    "loss_tokens",
    "lr",
    "empty_micro_batches",
    "activation_bytes",
    "peak_rss_mb",
    "state_mb",
)


@dataclass(frozen=True)
class TrainerStep:
    """What the trainer did in step `step` (steps count from 1; see rundir.paths)."""

    step: int
    train_s: float  # the step's training time (no waiting, no publishing)
    figures: dict[str, float] = field(default_factory=dict)  # loss, grad_norm, ...
    weight_version: int | None = None  # RL: the version the step published (= step)
    wait_s: float = 0.0  # RL: time spent waiting for the step's batch
    publish_s: float = 0.0  # RL: time spent publishing weights/vK
    peak_rss_mb: float = 0.0  # largest over ranks
    state_mb: float = 0.0  # parameters, gradients and optimizer state of one rank

    _FIELDS = (
        "step",
        "train_s",
        "weight_version",
        "wait_s",
        "publish_s",
        "peak_rss_mb",
        "state_mb",
    )

    def to_json(self) -> str:
        """The record as one line (no newline)."""
        flat: dict[str, Any] = {name: getattr(self, name) for name in self._FIELDS}
        if self.weight_version is None:
            del flat["weight_version"]
        return json.dumps(flat | self.figures)

    @classmethod
    def from_json(cls, line: str) -> TrainerStep:
        flat = json.loads(line)
        known = {name: flat.pop(name) for name in cls._FIELDS if name in flat}
        return cls(**known, figures=flat)

    def pick(self, names: tuple[str, ...]) -> dict[str, float]:
        """The named figures this record has (the memory fields count as figures)."""
        every = {"peak_rss_mb": self.peak_rss_mb, "state_mb": self.state_mb} | self.figures
        return {name: every[name] for name in names if name in every}
