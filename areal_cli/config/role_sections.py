"""The recipe sections of the supervised roles (`algorithm: sft`, `algorithm: rm`): part of
the schema (areal_cli.config.schema), kept apart to keep each file short."""

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
        "Column of chat conversations ([{role, content}]), trained on the assistant turns; empty: prompt/answer rows (dataset.prompt_key, dataset.answer_key).",
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
