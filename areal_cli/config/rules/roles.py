"""The rules of the roles (`algorithm:`): which sections and keys each one reads, and
what the reward model and the PPO critic need."""

from __future__ import annotations

from pathlib import Path

from areal_cli.config.allocation import AllocationMode
from areal_cli.config.checker import Checker
from areal_cli.config.errors import PATH_RULE
from areal_cli.config.model_info import model_config
from areal_cli.config.role_sections import SUPERVISED_EVAL_KEYS
from areal_cli.config.schema import RL_ACTOR_KEYS, RL_SECTIONS, ROLE_SECTIONS


def check_role_sections(c: Checker) -> None:
    """A role's own section (sft:, rm:, critic:) under another algorithm is an error."""
    for section, role in ROLE_SECTIONS.items():
        if c.cfg.algorithm != role and (section,) in c.loaded.locations:
            c.error(
                section,
                f"is only read by algorithm: {role}",
                f"remove it, or set algorithm: {role}",
            )


def check_reward_model(c: Checker, mode: AllocationMode | None) -> None:
    """algorithm: rm puts a scalar head on a causal LM (or trains a scalar-head model on);
    its score is read at each sequence's last token, which context parallelism would put
    on another rank, so c > 1 is refused."""
    if mode is not None and mode.train is not None and mode.train.context_parallel_size > 1:
        c.error(
            "allocation_mode",
            "algorithm: rm does not support context parallelism (c > 1) yet",
            f"drop c from '{c.cfg.allocation_mode}'; reward models see short sequences",
        )
    config = model_config(c.cfg.model.path) if c.valid("model.path") else None
    if config is None or "architectures" not in config:
        return  # a builtin (a causal LM), or a model that is not on this machine
    architecture = (config.get("architectures") or [""])[0]
    if not (
        architecture.endswith("ForCausalLM") or architecture.endswith("ForSequenceClassification")
    ):
        c.error(
            "model.path",
            f"algorithm: rm needs a causal LM or a sequence-classification model, but {c.cfg.model.path} is a {architecture or 'model with no architectures entry'}",
            "give an HF folder whose config.json names a *ForCausalLM architecture",
        )


def check_dpo(c: Checker, mode: AllocationMode | None) -> None:
    """algorithm: dpo sums each answer's logprobs on one rank, so c > 1 is refused; its
    two actor keys do nothing under another algorithm."""
    if c.cfg.algorithm != "dpo":
        for key in ("beta", "loss_type"):
            if ("actor", key) in c.loaded.locations:
                c.warn(
                    f"actor.{key}",
                    f"is read by algorithm: dpo only, not {c.cfg.algorithm}",
                    "remove it",
                )
        return
    if mode is not None and mode.train is not None and mode.train.context_parallel_size > 1:
        c.error(
            "allocation_mode",
            "algorithm: dpo does not support context parallelism (c > 1) yet",
            f"drop c from '{c.cfg.allocation_mode}'; use d or t",
        )


def check_critic(c: Checker, mode: AllocationMode | None, launch: bool) -> None:
    """algorithm: ppo: group advantages are not read (GAE replaces them), the critic's
    starting model must exist for a run, and context parallelism is refused (GAE reads
    whole sequences on one rank)."""
    if ("actor", "adv_estimator") in c.loaded.locations:
        c.error(
            "actor.adv_estimator",
            "is not used by algorithm: ppo (advantages come from the critic, by GAE)",
            "remove it; critic.gamma and critic.lam shape the advantages",
        )
    if mode is not None and mode.train is not None and mode.train.context_parallel_size > 1:
        c.error(
            "allocation_mode",
            "algorithm: ppo does not support context parallelism (c > 1) yet",
            f"drop c from '{c.cfg.allocation_mode}'",
        )
    path = c.cfg.critic.path
    if path and c.valid("critic.path") and not Path(path).exists():
        fix = f"check the path ({PATH_RULE}), or leave it empty"
        if launch:
            c.error("critic.path", f"model path does not exist: {path}", fix)
        else:  # a plan needs no weights (DESIGN §1)
            c.warn(
                "critic.path", f"model path does not exist yet: {path}; a real run needs it", fix
            )


def check_role_keys(c: Checker) -> None:
    """Under a supervised role, a key that only RL reads is an error (it would be ignored)."""
    seen: set[str] = set()
    for path in c.loaded.locations:
        if any(key[: len(path)] == tuple(path) for key in SUPERVISED_EVAL_KEYS):
            continue  # the role's held-out rows and their frequency (supervised_eval)
        if path[0] in RL_SECTIONS:
            key = path[0]
        elif path[0] == "actor" and len(path) > 1 and path[1] in RL_ACTOR_KEYS:
            key = f"actor.{path[1]}"
        else:
            continue
        if key not in seen:
            seen.add(key)
            c.error(
                key,
                f"is not used by algorithm: {c.cfg.algorithm} (it trains on the dataset's rows, with no rollouts or inference server)",
                "remove it, or set algorithm: grpo",
            )
