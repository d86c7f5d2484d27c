"""The DPO role (`algorithm: dpo`): direct preference optimization on preference pairs.

Data: the reward model's (areal_cli.trainer.rm.load_pairs, with the `dpo` section's keys):
each row's prompt as the rollout renders it, then the chosen or the rejected answer and
EOS. Only the answer tokens are scored: a side's logprob is the sum over them.

Models: the policy (the actor, from model.path) and a frozen copy of model.path, the
reference, sharded the same way (as the RL actor's reference under actor.kl_ctl). Each
micro-batch runs the reference's forward (no grad) and the policy's, on the same tokens.

Loss (losses.dpo_loss, `actor.loss_type`): with the implicit reward
r = actor.beta * (log pi - log pi_ref), sigmoid is -log sigmoid(r_chosen - r_rejected);
ipo is the squared distance of the per-token log-ratio margin from 1 / (2 beta). Pairs
are the unit, split and packed as the RM role does (both sides of a pair in one
micro-batch), and the loss is normalised by the step's global number of pairs, so the
gradient is the same at every layout.

Figures: loss, accuracy (the share of pairs whose reward margin is > 0: at the first step
the policy is the reference, every margin is 0 and the accuracy 0, as in AReaL and TRL),
margin, chosen_reward, rejected_reward, and logp_accuracy (the share where the policy
itself gives the chosen answer the higher logprob, which is meaningful from the start).
Eval: the same over every pair of `dpo.eval_path`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from areal_cli.config.role_sections import supervised_eval
from areal_cli.config.schema import ExperimentConfig
from areal_cli.data.prompts import DatasetError
from areal_cli.rundir.batch import RolloutBatch
from areal_cli.trainer import losses
from areal_cli.trainer.actor import frozen_model
from areal_cli.trainer.layout import StepLayout
from areal_cli.trainer.rm import PairRole, Pairs, load_pairs
from areal_cli.trainer.sft import step_indices
from areal_cli.trainer.state import Beat, TrainerState
from areal_cli.trainer.step import (
    Stats,
    agree_on_plans,
    empty_forward,
    forward_logprobs,
    split_range,
)
from areal_cli.trainer.supervised import update

_SUMS = (
    "loss", "correct", "logp_correct", "pairs", "margin", "chosen_reward", "rejected_reward",
    "empty_micro_batches",
)  # fmt: skip


def pair_batch(pairs: Pairs, ids: list[int]) -> RolloutBatch:
    """The chosen sides of pairs `ids`, then their rejected sides, as a batch whose loss
    mask is each answer's tokens (the prompt is context only)."""
    seqs = []
    for side in (pairs.chosen, pairs.rejected):
        for i in ids:
            tokens = torch.tensor(side[i], dtype=torch.long)
            mask = torch.zeros(len(tokens), dtype=torch.long)
            mask[pairs.prompt_lens[i] :] = 1
            seqs.append(
                {
                    "input_ids": tokens,
                    "loss_mask": mask,
                    "logprobs": torch.zeros(len(tokens)),
                    "versions": torch.zeros(len(tokens), dtype=torch.long),
                }
            )
    return RolloutBatch.from_sequences(seqs, [0.0] * len(seqs), group_size=1)


def answer_logprobs(
    model: nn.Module, batch: RolloutBatch, layout: StepLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed logprob over its answer tokens, and their count (one packed
    forward; context parallelism is refused for DPO, so each rank sees whole sequences)."""
    n = batch.n_seqs
    logp, _, t = forward_logprobs(model, batch, list(range(n)), 1.0, layout, entropy=False)
    mask = t["loss_mask"].to(logp.dtype)
    ids = t["seq_ids"].long()
    sums = logp.new_zeros(n + 1).index_add(0, ids, logp * mask)[:n]
    counts = mask.detach().new_zeros(n + 1).index_add(0, ids, mask.detach())[:n]
    return sums, counts


def _pair_pass(
    policy: nn.Module,
    ref: nn.Module,
    pairs: Pairs,
    index: list[int],
    cfg: ExperimentConfig,
    layout: StepLayout,
    beat: Beat,
    train: bool,
    ref_cache: RefCache | None = None,
) -> dict[str, float]:
    """Loss and figures over `index` (the step's or the eval's pairs): this rank's share
    in micro-batches agreed with the other ranks, the reference's forward then the
    policy's in each; with `train`, the gradients too. Collective over every rank.

    With `ref_cache` (the held-out eval's), the reference's logprobs of each micro-batch
    are taken from it once it holds this pass's, and kept in it otherwise: the reference
    is frozen and the held-out pairs and their plan are the same at every eval, so they
    never change. Every rank fills it at the same eval and then skips the same forwards."""
    mine = [index[i] for i in split_range(len(index), layout.dp_size, layout.dp_rank)]
    plan = agree_on_plans([pairs.lengths(mine)], cfg.actor)[0]
    cached = ref_cache.lookup(plan.micro_batches) if ref_cache is not None else None
    computed: list[torch.Tensor | None] = []
    stats = Stats(list(_SUMS), [])
    tag = "train" if train else "eval"
    for j, mb in enumerate(plan.micro_batches):
        beat(f"{tag} mb {j + 1}/{len(plan.micro_batches)}")
        if not mb:
            computed.append(None)
            if cached is None:
                with torch.no_grad():
                    empty_forward(ref, layout)
            empty = empty_forward(policy, layout)
            if train:
                (empty * layout.data_world).backward()
            stats.add("empty_micro_batches", 1)
            continue
        ids = [mine[i] for i in mb]
        k = len(ids)
        batch = pair_batch(pairs, ids)
        if cached is not None:
            ref_logp = cached[j]
        else:
            with torch.no_grad():
                ref_logp, _ = answer_logprobs(ref, batch, layout)
        computed.append(ref_logp)
        with torch.set_grad_enabled(train):
            logp, counts = answer_logprobs(policy, batch, layout)
        a = cfg.actor
        loss, s = losses.dpo_loss(
            logp[:k], logp[k:], ref_logp[:k], ref_logp[k:], a.beta, a.loss_type, counts[:k], counts[k:]
        )  # fmt: skip
        loss = loss.sum() / len(index)
        if train:
            (loss * layout.data_world).backward()
        stats.add("loss", loss.detach())
        stats.add("pairs", float(k))
        stats.add("logp_correct", (logp[:k] > logp[k:]).sum())
        for key in ("correct", "margin", "chosen_reward", "rejected_reward"):
            stats.add(key, s[key].sum())
    if ref_cache is not None and cached is None:
        ref_cache.keep(plan.micro_batches, computed)
    out = stats.reduce(layout.stats_group)
    n = max(out.pop("pairs"), 1.0)
    result = {"loss": out.pop("loss"), "pairs": n}
    result["accuracy"] = out.pop("correct") / n
    result["logp_accuracy"] = out.pop("logp_correct") / n
    for key in ("margin", "chosen_reward", "rejected_reward"):
        result[key] = out.pop(key) / n
    result["empty_micro_batches"] = out.pop("empty_micro_batches")
    return result


@dataclass
class RefCache:
    """The reference's answer logprobs per micro-batch of one pass (the held-out eval's),
    with the micro-batches they belong to; see _pair_pass."""

    micro_batches: list[list[int]] | None = None
    logprobs: list[torch.Tensor | None] = field(default_factory=list)

    def lookup(self, micro_batches: list[list[int]]) -> list[torch.Tensor | None] | None:
        """The kept logprobs when they are this plan's; None before the first pass."""
        if self.micro_batches is None:
            return None
        if self.micro_batches != micro_batches:  # the same pairs always plan the same
            raise RuntimeError("the held-out pairs planned other micro-batches than before")
        return self.logprobs

    def keep(self, micro_batches: list[list[int]], logprobs: list[torch.Tensor | None]) -> None:
        self.micro_batches = [list(mb) for mb in micro_batches]
        self.logprobs = logprobs


@dataclass
class DPORole(PairRole):
    """algorithm: dpo, as the trainer's loop drives it (state.Role)."""

    train: Pairs
    held_out: Pairs | None
    ref_model: nn.Module
    held_out_ref: RefCache = field(default_factory=RefCache)

    @classmethod
    def build(cls, state: TrainerState) -> DPORole:
        """Tokenize the pairs (every rank) and build the frozen reference (collective)."""
        state.beat.phase("tokenize dataset")
        train, held_out = _load(state.cfg, state.actor.model_dir)
        state.beat.phase("build reference model")
        return cls(train, held_out, frozen_model(state.actor.model_dir, state))

    def describe(self) -> str:
        return (
            f"dpo: {len(self.train)} pairs ({self.train.skipped} longer than dpo.max_len "
            f"skipped), {len(self.held_out) if self.held_out else 0} held out"
        )

    def train_on(self, state: TrainerState, step: int, beat: Beat) -> dict[str, float]:
        """One optimizer step on step `step`'s pairs."""
        cfg, a = state.cfg, state.actor
        index = step_indices(
            len(self.train), cfg.dpo.batch_size, step, cfg.dataset.seed, cfg.dataset.shuffle
        )
        out = _pair_pass(
            a.model, self.ref_model, self.train, index, cfg, state.layout, beat, train=True
        )
        return update(state, out, beat)

    @torch.no_grad()
    def evaluate(self, state: TrainerState, beat: Beat) -> dict[str, float]:
        """Held-out loss, reward accuracy and margin (collective)."""
        assert self.held_out is not None
        index = list(range(len(self.held_out)))
        out = _pair_pass(
            state.actor.model, self.ref_model, self.held_out, index, state.cfg, state.layout,
            beat, train=False, ref_cache=self.held_out_ref,
        )  # fmt: skip
        return {
            "eval_loss": out["loss"],
            "eval_accuracy": out["accuracy"],
            "eval_margin": out["margin"],
            "eval_logp_accuracy": out["logp_accuracy"],
        }


def _load(cfg: ExperimentConfig, model_dir: Path) -> tuple[Pairs, Pairs | None]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_dir)
    train = load_pairs(cfg, tokenizer, cfg.dataset.path)
    if not len(train):
        raise DatasetError(f"no pair of {cfg.dataset.path} fits dpo.max_len={cfg.dpo.max_len}")
    path, _ = supervised_eval(cfg)
    return train, (load_pairs(cfg, tokenizer, path) if path else None)
