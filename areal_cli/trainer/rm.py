"""The reward-model role (`algorithm: rm`): Bradley-Terry on preference pairs.

Data: each `dataset` row holds a prompt (`dataset.prompt_key`) and two answers, the
preferred one (`rm.chosen_key`) and the other (`rm.rejected_key`). Each side becomes the
prompt as the rollout renders it, then the answer's tokens and EOS: the tokens an RL run
would show the model to score (areal_cli.rollout.rewards, `model:PATH`). A pair whose
longer side exceeds `rm.max_len` is skipped.

Model: a scalar head on the body of `model.path` (areal_cli.models.scalar_head); the
score of a conversation is the head's output at its last token.

Steps: pairs, not sequences, are the unit. Step s takes pairs s*B .. s*B+B-1 of an
endless sequence of shuffled epochs (as SFT does, `sft.step_indices`). The pairs are split
over the dp ranks and packed into micro-batches whole (both sides of a pair in one
micro-batch, `step.agree_on_plans`), so each micro-batch's loss is complete. The loss is
mean over the step's pairs of -log sigmoid(score(chosen) - score(rejected)), normalised by
the step's global number of pairs, so the gradient is the same at every layout.

Eval: the same loss and the pairwise accuracy (the share of pairs where the chosen side
scores higher) over every pair of `rm.eval_path`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from areal_cli.config.role_sections import supervised_eval
from areal_cli.config.schema import ExperimentConfig
from areal_cli.data.prompts import DatasetError, format_prompt, load_prompts, reply_ids
from areal_cli.trainer.layout import StepLayout
from areal_cli.trainer.packing import pack_sequences, to_device
from areal_cli.trainer.sft import step_indices
from areal_cli.trainer.state import Beat, TrainerState
from areal_cli.trainer.step import (
    Stats,
    agree_on_plans,
    empty_forward,
    split_range,
)
from areal_cli.trainer.supervised import SupervisedRole, update


@dataclass(frozen=True)
class Pairs:
    """Tokenized preference pairs (chosen, rejected), and how many rows were too long."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    skipped: int
    prompt_lens: list[int] = dataclasses.field(default_factory=list)  # shared by both sides

    def __len__(self) -> int:
        return len(self.chosen)

    def lengths(self, index: list[int]) -> list[int]:
        return [len(self.chosen[i]) + len(self.rejected[i]) for i in index]


def load_pairs(cfg: ExperimentConfig, tokenizer: Any, path: str) -> Pairs:
    """Tokenize every row of `path` (a file with the columns of `dataset` and of the
    role's section: `rm`, or `dpo` under algorithm: dpo)."""
    rm = cfg.dpo if cfg.algorithm == "dpo" else cfg.rm
    data = dataclasses.replace(
        cfg.dataset, path=path, answer_key=rm.chosen_key, max_prompt_len=10**9
    )
    rows = load_prompts(data)  # checks the prompt and chosen columns
    if rm.rejected_key not in rows[0]:
        raise DatasetError(
            f"{path} has no column '{rm.rejected_key}' (rm.rejected_key); it has "
            f"{', '.join(sorted(rows[0]))}"
        )
    chosen, rejected, prompt_lens, skipped = [], [], [], 0
    for n, row in enumerate(rows):
        prompt = format_prompt(tokenizer, row, data)
        where = f"{path} row {n}"
        good = prompt + reply_ids(tokenizer, row[rm.chosen_key], where)
        bad = prompt + reply_ids(tokenizer, row[rm.rejected_key], where)
        if max(len(good), len(bad)) > rm.max_len:
            skipped += 1
            continue
        chosen.append(good)
        rejected.append(bad)
        prompt_lens.append(len(prompt))
    return Pairs(chosen, rejected, skipped, prompt_lens)


def last_token_scores(
    model: nn.Module, sequences: list[list[int]], layout: StepLayout
) -> torch.Tensor:
    """The head's output at each sequence's last token, from one packed forward."""
    device = next(model.parameters()).device
    packed = pack_sequences([torch.tensor(s, dtype=torch.long) for s in sequences])
    ids, positions, last = (
        to_device(t, device)
        for t in (packed.input_ids, packed.position_ids, packed.cu_seqlens[1:] - 1)
    )
    with layout.attention.micro_batch(layout.cp_group, layout.cp_size, packed.seq_ids, device):
        out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False)
    return out[0].float()[last]


def _pair_pass(
    model: nn.Module,
    pairs: Pairs,
    index: list[int],
    n_total: int,
    cfg: ExperimentConfig,
    layout: StepLayout,
    beat: Beat,
    train: bool,
) -> dict[str, float]:
    """Loss, accuracy and score sums over `index` (the whole step's or eval's pairs):
    this rank's share, in micro-batches agreed with the other ranks; with `train`, the
    gradients too. Collective over every trainer rank."""
    mine = [index[i] for i in split_range(len(index), layout.dp_size, layout.dp_rank)]
    plan = agree_on_plans([pairs.lengths(mine)], cfg.actor)[0]
    stats = Stats(["loss", "correct", "pairs", "margin", "chosen_score", "empty_micro_batches"], [])
    tag = "train" if train else "eval"
    for j, mb in enumerate(plan.micro_batches):
        beat(f"{tag} mb {j + 1}/{len(plan.micro_batches)}")
        if not mb:
            empty = empty_forward(model, layout)
            if train:
                (empty * layout.data_world).backward()
            stats.add("empty_micro_batches", 1)
            continue
        ids = [mine[i] for i in mb]
        scores = last_token_scores(
            model, [pairs.chosen[i] for i in ids] + [pairs.rejected[i] for i in ids], layout
        )
        margin = scores[: len(ids)] - scores[len(ids) :]
        loss = -F.logsigmoid(margin).sum() / n_total
        if train:
            (loss * layout.data_world).backward()
        stats.add("loss", loss.detach())
        stats.add("correct", (margin.detach() > 0).sum())
        stats.add("pairs", float(len(ids)))
        stats.add("margin", margin.detach().sum())
        stats.add("chosen_score", scores[: len(ids)].detach().sum())
    out = stats.reduce(layout.stats_group)
    n = max(out.pop("pairs"), 1.0)
    return {
        "loss": out["loss"],
        "accuracy": out["correct"] / n,
        "margin": out["margin"] / n,
        "chosen_score": out["chosen_score"] / n,
        "pairs": n,
        "empty_micro_batches": out["empty_micro_batches"],
    }


class PairRole(SupervisedRole):
    """A role that trains on preference pairs (rm, dpo): held-out pairs, when given, are
    evaluated every ROLE.eval_freq_steps."""

    held_out: Pairs | None

    @property
    def has_eval(self) -> bool:
        return self.held_out is not None

    def eval_freq_steps(self, cfg: ExperimentConfig) -> int:
        return supervised_eval(cfg)[1]


@dataclass
class RewardModelRole(PairRole):
    """algorithm: rm, as the trainer's loop drives it (state.Role)."""

    train: Pairs
    held_out: Pairs | None

    @classmethod
    def build(cls, state: TrainerState) -> RewardModelRole:
        """Tokenize the preference pairs (every rank)."""
        state.beat.phase("tokenize dataset")
        return cls.from_config(state.cfg, state.actor.model_dir)

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, model_dir: Path) -> RewardModelRole:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_dir)
        train = load_pairs(cfg, tokenizer, cfg.dataset.path)
        if not len(train):
            raise DatasetError(f"no pair of {cfg.dataset.path} fits rm.max_len={cfg.rm.max_len}")
        path, _ = supervised_eval(cfg)
        held_out = load_pairs(cfg, tokenizer, path) if path else None
        return cls(train, held_out)

    def describe(self) -> str:
        return (
            f"rm: {len(self.train)} pairs ({self.train.skipped} longer than rm.max_len "
            f"skipped), {len(self.held_out) if self.held_out else 0} held out"
        )

    def train_on(self, state: TrainerState, step: int, beat: Beat) -> dict[str, float]:
        """One optimizer step on step `step`'s pairs."""
        cfg, a, layout = state.cfg, state.actor, state.layout
        index = step_indices(
            len(self.train), cfg.rm.batch_size, step, cfg.dataset.seed, cfg.dataset.shuffle
        )
        out = _pair_pass(a.model, self.train, index, len(index), cfg, layout, beat, train=True)
        return update(state, out, beat)

    @torch.no_grad()
    def evaluate(self, state: TrainerState, beat: Beat) -> dict[str, float]:
        """Held-out loss and pairwise accuracy (collective)."""
        assert self.held_out is not None
        index = list(range(len(self.held_out)))
        out = _pair_pass(
            state.actor.model, self.held_out, index, len(index), state.cfg, state.layout, beat,
            train=False,
        )  # fmt: skip
        return {"eval_loss": out["loss"], "eval_accuracy": out["accuracy"]}
