"""The recipe sections of the supervised roles (`algorithm: sft`, `rm`, `dpo`): the
schema of what only those roles read. areal_cli.config.schema holds the sections every
run reads and the RL ones, and puts these under ExperimentConfig."""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli.config.fields import field


@dataclass
class SFTConfig:
    """Supervised fine-tuning (algorithm: sft) on the `dataset` rows: the loss on answer
    tokens (areal_cli.trainer.sft)."""

    batch_size: int = field(32, "Examples per step, over all trainer ranks.", ge=1)
    max_len: int = field(
        1024, "Examples longer than this many tokens (prompt and answer) are skipped.", ge=2
    )
    messages_key: str = field(
        "",
        'Column of chat conversations ([{role, content}]), trained on the assistant turns (one with "weight": 0 is context only); empty: prompt/answer rows (dataset.prompt_key, dataset.answer_key).',
    )
    tools_key: str = field(
        "",
        "With messages_key: a column of OpenAI tool schemas ([{type: function, function: {...}}]) the chat template renders before the conversation, as the agent proxy does for a request's tools; assistant turns may hold tool_calls and tool turns their results. Empty: no tools.",
    )
    label_smoothing: float = field(
        0.0,
        "Target weight moved from each answer token to the smoothing support, spread evenly.",
        ge=0,
        lt=1,
    )
    smoothing_support: str = field(
        "vocab",
        "Tokens label smoothing spreads over: vocab (all), or targets (the tokens that occur as targets in the training set).",
        choices=("vocab", "targets"),
    )
    eval_path: str = field(
        "",
        "Held-out rows (.jsonl or .parquet, the dataset's columns); empty: no eval loss.",
        path=True,
    )
    eval_freq_steps: int = field(
        10, "Held-out loss every this many steps, and after the last one.", ge=1
    )


@dataclass
class RMConfig:
    """Reward-model training (algorithm: rm) on preference rows of `dataset`: the prompt
    (dataset.prompt_key) with a chosen and a rejected answer; the Bradley-Terry loss on the
    scalar head's score of each whole conversation (areal_cli.trainer.rm)."""

    batch_size: int = field(32, "Preference pairs per step, over all trainer ranks.", ge=1)
    max_len: int = field(
        1024,
        "Pairs whose longer side (prompt and answer) exceeds this many tokens are skipped.",
        ge=2,
    )
    chosen_key: str = field("chosen", "Column of the preferred answer.")
    rejected_key: str = field("rejected", "Column of the answer it is preferred to.")
    eval_path: str = field(
        "",
        "Held-out pairs (.jsonl or .parquet, the dataset's columns); empty: no eval accuracy.",
        path=True,
    )
    eval_freq_steps: int = field(
        10,
        "Held-out loss and pairwise accuracy every this many steps, and after the last one.",
        ge=1,
    )


@dataclass
class DPOConfig(RMConfig):
    """Direct preference optimization (algorithm: dpo) on the same preference rows as rm:
    the policy itself, against a frozen copy of model.path, learns to prefer the chosen
    answer (areal_cli.trainer.dpo; actor.beta and actor.loss_type set the loss)."""


@dataclass
class CriticConfig:
    """The critic of PPO (algorithm: ppo): a value model trained beside the actor on the
    same trainer ranks, whose values give per-token advantages by GAE
    (areal_cli.trainer.critic). Its optimizer is the actor's (actor.optimizer) with its own
    learning rate."""

    path: str = field(
        "",
        "The critic's starting model: a scalar-head folder, or a causal LM whose body gets a new head; empty: the body of model.path.",
        path=True,
    )
    lr: float = field(1.0e-3, "The critic's learning rate.", gt=0)
    gamma: float = field(1.0, "GAE discount per token.", ge=0, le=1)
    lam: float = field(0.95, "GAE lambda.", ge=0, le=1)
    value_eps_clip: float = field(
        0.2, "Clip the new value to within this of the value at rollout time; 0: no clipping.", ge=0
    )
    value_loss_coef: float = field(1.0, "Weight of the value loss in the critic's gradient.", gt=0)
    epochs: int = field(
        1,
        "Optimizer steps of the critic on each minibatch after the actor's update (PPO's value epochs).",
        ge=1,
    )
    whiten_advantages: bool = field(
        True, "Normalise the batch's advantages to mean 0 and std 1 before the actor's loss."
    )


# The eval keys a supervised role reads too: `eval.dataset.path` as its held-out rows and
# `eval.freq_steps` as how often, in place of ROLE.eval_path and ROLE.eval_freq_steps.
SUPERVISED_EVAL_KEYS = (("eval", "dataset", "path"), ("eval", "freq_steps"))


def supervised_eval(cfg) -> tuple[str, int]:
    """A supervised role's held-out rows and how often it evaluates them: its own
    ROLE.eval_path and ROLE.eval_freq_steps, or the eval section's dataset.path and
    freq_steps (the section that drives evaluation during RL training)."""
    role = getattr(cfg, cfg.algorithm)
    return role.eval_path or cfg.eval.dataset.path, cfg.eval.freq_steps or role.eval_freq_steps
