"""The SFT role (`algorithm: sft`): supervised fine-tuning on answer tokens.

Data: `dataset` rows are either prompt/answer pairs (`dataset.prompt_key`,
`dataset.answer_key`) or chat conversations (`sft.messages_key`: a list of
{role, content}). A pair becomes the prompt as the rollout renders it (chat template with
the generation prompt, `dataset.system_prompt`), then the answer's tokens and EOS: exactly
what a server would have to generate. A conversation is rendered whole; the tokens each
assistant turn adds are its targets. The loss is on target tokens only.

Steps: every rank tokenizes the whole dataset, and step k (from 1) takes examples
(k-1)*B .. k*B-1 of
an endless sequence of epochs, each shuffled with `dataset.seed` + epoch (B =
`sft.batch_size`). So a step's examples depend on the step number only, and a resumed run
continues exactly. The step itself is the actor's machinery (areal_cli.trainer.step):
sequences split over the dp ranks, packed micro-batches agreed across ranks, one optimizer
step, the loss normalised by the step's global number of target tokens, so the gradient
is the same at every layout.

Label smoothing (`sft.label_smoothing` = e): each target token's loss is
(1 - e) * NLL + e * (minus the mean logprob over the support): the whole vocabulary, or
with `smoothing_support: targets` the tokens that occur as targets anywhere in the
training set (for the demo's sums: the ten digits and EOS), so the model stays unsure
between answers without learning to write other tokens. With tensor parallelism the mean
is read from the vocabulary shards (`losses.support_logprob_mean`), never gathered.

Eval: the mean NLL per target token over `sft.eval_path` (no smoothing), a forward over
every example.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from areal_cli.config.role_sections import supervised_eval
from areal_cli.config.schema import ExperimentConfig, TrainEngineConfig
from areal_cli.data.chat import ChatRequestError, template_message
from areal_cli.data.prompts import (
    DatasetError,
    chat_ids,
    format_prompt,
    load_prompts,
    reply_ids,
)
from areal_cli.rundir.batch import RolloutBatch
from areal_cli.trainer import losses
from areal_cli.trainer.layout import StepLayout
from areal_cli.trainer.state import Beat, TrainerState, vocab_size
from areal_cli.trainer.step import (
    Stats,
    agree_on_micro_batches,
    empty_forward,
    forward_logprobs,
    global_normalizer,
    optimizer_step,
    split_range,
)
from areal_cli.trainer.supervised import SupervisedRole


@dataclass(frozen=True)
class Examples:
    """Tokenized examples: ids and target masks, and how many rows were too long."""

    input_ids: list[list[int]]
    targets: list[list[int]]
    skipped: int

    def __len__(self) -> int:
        return len(self.input_ids)

    def batch(self, index: list[int]) -> RolloutBatch:
        """The examples at `index` as a batch the trainer's step takes (targets as the loss
        mask; behaviour logprobs, versions and rewards unused)."""
        seqs = []
        for i in index:
            ids = torch.tensor(self.input_ids[i], dtype=torch.long)
            seqs.append(
                {
                    "input_ids": ids,
                    "loss_mask": torch.tensor(self.targets[i], dtype=torch.long),
                    "logprobs": torch.zeros(len(ids)),
                    "versions": torch.zeros(len(ids), dtype=torch.long),
                }
            )
        return RolloutBatch.from_sequences(seqs, [0.0] * len(seqs), group_size=1)


@dataclass
class SFTRole(SupervisedRole):
    """algorithm: sft, as the trainer's loop drives it (state.Role): what it trains and
    evaluates on, and the label-smoothing support."""

    train: Examples
    eval: Examples | None
    support: torch.Tensor | None  # token ids; None: no label smoothing

    @classmethod
    def build(cls, state: TrainerState) -> SFTRole:
        """Tokenize the dataset (every rank)."""
        state.beat.phase("tokenize dataset")
        return cls.from_config(state.cfg, state.actor.model_dir, vocab_size(state.actor.model))

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, model_dir: Path, vocab: int) -> SFTRole:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_dir)
        train = load_examples(cfg, tokenizer, cfg.dataset.path)
        if not len(train):
            raise DatasetError(
                f"no example of {cfg.dataset.path} fits sft.max_len={cfg.sft.max_len}"
            )
        path, _ = supervised_eval(cfg)
        held_out = load_examples(cfg, tokenizer, path) if path else None
        support = None
        if cfg.sft.label_smoothing > 0:
            if cfg.sft.smoothing_support == "targets":
                ids = {
                    t
                    for x, m in zip(train.input_ids, train.targets, strict=True)
                    for t, on in zip(x, m, strict=True)
                    if on
                }
                support = torch.tensor(sorted(ids), dtype=torch.long)
            else:
                support = torch.arange(vocab)
        return cls(train, held_out, support)

    def describe(self) -> str:
        return (
            f"sft: {len(self.train)} examples ({self.train.skipped} longer than sft.max_len "
            f"skipped), {len(self.eval) if self.eval else 0} held out"
        )

    def train_on(self, state: TrainerState, step: int, beat: Beat) -> dict[str, float]:
        """One optimizer step on step `step`'s examples."""
        cfg, a = state.cfg, state.actor
        index = step_indices(
            len(self.train), cfg.sft.batch_size, step, cfg.dataset.seed, cfg.dataset.shuffle
        )
        batch = self.train.batch(index)
        return sft_step(
            a.model, a.optimizer, a.scheduler, batch, cfg, self.support, state.layout, beat
        )

    @property
    def has_eval(self) -> bool:
        return self.eval is not None

    def eval_freq_steps(self, cfg: ExperimentConfig) -> int:
        return supervised_eval(cfg)[1]

    def evaluate(self, state: TrainerState, beat: Beat) -> dict[str, float]:
        assert self.eval is not None
        loss = eval_loss(state.actor.model, self.eval, state.cfg.actor, state.layout, beat)
        return {"eval_loss": loss}


def load_examples(cfg: ExperimentConfig, tokenizer: Any, path: str) -> Examples:
    """Tokenize every row of `path` (a file with the columns of `dataset`)."""
    data = dataclasses.replace(cfg.dataset, path=path)
    key = cfg.sft.messages_key
    if key:  # the loader checks both configured columns: here the one conversation column
        data = dataclasses.replace(data, prompt_key=key, answer_key=key)
    ids_all, targets_all, skipped = [], [], 0
    tools_key = cfg.sft.tools_key
    for n, row in enumerate(load_prompts(data)):
        if key:
            tools = row.get(tools_key) if tools_key else None
            ids, targets = _conversation(tokenizer, row[key], n, path, tools)
        else:
            prompt = format_prompt(tokenizer, row, dataclasses.replace(data, max_prompt_len=10**9))
            reply = reply_ids(tokenizer, row[cfg.dataset.answer_key], f"{path} row {n}")
            ids, targets = prompt + reply, [0] * len(prompt) + [1] * len(reply)
        if len(ids) > cfg.sft.max_len:
            skipped += 1
            continue
        ids_all.append(ids)
        targets_all.append(targets)
    return Examples(ids_all, targets_all, skipped)


def _conversation(
    tokenizer: Any, messages: Any, n: int, path: str, tools: Any = None
) -> tuple[list[int], list[int]]:
    """A whole conversation's ids, with the tokens of each assistant turn as targets (its
    tool calls too: with `tools`, rendered as the agent proxy renders a request); an
    assistant turn with `"weight": 0` is context only, as in Axolotl's chat datasets."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise DatasetError(f"{path} row {n}: messages must be a list of {{role, content}}")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise DatasetError(f"{path} row {n}: tools must be a list of OpenAI tool objects")
    trained = [m.get("role") == "assistant" and m.get("weight", 1) != 0 for m in messages]
    try:
        messages = [template_message(m) for m in messages]
    except ChatRequestError as err:
        raise DatasetError(f"{path} row {n}: {err}") from None
    ids: list[int] = []
    targets: list[int] = []
    for i in range(len(messages)):
        if not trained[i]:
            continue
        before = chat_ids(tokenizer, messages[:i], tools=tools)  # ends with the generation prompt
        whole = chat_ids(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        if whole[: len(before)] != before or whole[: len(ids)] != ids:
            raise DatasetError(
                f"{path} row {n}: the chat template renders turn {i} differently once the "
                "conversation goes on, so its tokens cannot be found; use prompt/answer rows"
            )
        targets += [0] * (len(before) - len(ids)) + [1] * (len(whole) - len(before))
        ids = whole
    if not ids:
        raise DatasetError(f"{path} row {n}: the conversation has no assistant turn")
    return ids, targets


def step_indices(
    n_examples: int, batch_size: int, step: int, seed: int, shuffle: bool
) -> list[int]:
    """The examples of `step` (from 1): positions (step-1)*B .. step*B-1 of the endless
    sequence of epochs, each epoch a permutation seeded with seed + epoch."""
    out = []
    for position in range((step - 1) * batch_size, step * batch_size):
        epoch, offset = divmod(position, n_examples)
        out.append(_epoch_order(n_examples, seed + epoch, shuffle)[offset])
    return out


@functools.lru_cache(maxsize=4)
def _epoch_order(n_examples: int, seed: int, shuffle: bool) -> tuple[int, ...]:
    order = list(range(n_examples))
    if shuffle:
        random.Random(seed).shuffle(order)
    return tuple(order)


def sft_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batch: RolloutBatch,
    cfg: ExperimentConfig,
    support: torch.Tensor | None,
    layout: StepLayout,
    beat: Beat,
) -> dict[str, float]:
    """One optimizer step of the (smoothed) negative log-likelihood of the target tokens;
    collective over every trainer rank, with the actor's micro-batch agreement."""
    smoothing = cfg.sft.label_smoothing if support is not None else 0.0
    stats = Stats(["loss", "nll", "loss_tokens", "tokens", "empty_micro_batches"], [])
    shard = [list(split_range(batch.n_seqs, layout.dp_size, layout.dp_rank))]
    plan = agree_on_micro_batches(batch, shard, cfg.actor)[0]
    normalizer = global_normalizer(batch, list(range(batch.n_seqs)), "token_mean")
    for j, mb in enumerate(plan.micro_batches):
        beat(f"train mb {j + 1}/{len(plan.micro_batches)}")
        if not mb:
            (empty_forward(model, layout) * layout.data_world).backward()
            stats.add("empty_micro_batches", 1)
            continue
        seqs = [shard[0][i] for i in mb]
        logp, _, t = forward_logprobs(model, batch, seqs, 1.0, layout, support, entropy=False)
        mask = t["loss_mask"].bool()
        loss_tok = -logp
        if smoothing:
            loss_tok = (1.0 - smoothing) * loss_tok - smoothing * t["support_logp"]
        loss = losses.aggregate_loss(loss_tok, mask, normalizer, "token_mean", t["seq_ids"])
        (loss * layout.data_world).backward()
        stats.add("loss", loss.detach())
        stats.add("nll", -(logp.detach() * mask).sum())
        stats.add("loss_tokens", float(mask.sum()))
        stats.add("tokens", float(t["real"].sum()))
    beat("optimizer step")
    norm = optimizer_step(model, optimizer, cfg.actor.optimizer.gradient_clipping)
    scheduler.step()
    out = stats.reduce(layout.stats_group)
    out["nll"] /= max(out["loss_tokens"], 1.0)  # the unsmoothed loss, comparable to eval_loss
    out["grad_norm"] = norm
    out["lr"] = optimizer.param_groups[0]["lr"]
    return out


@torch.no_grad()
def eval_loss(
    model: nn.Module, examples: Examples, cfg: TrainEngineConfig, layout: StepLayout, beat: Beat
) -> float:
    """Mean loss per target token over every example (collective over every rank)."""
    batch = examples.batch(list(range(len(examples))))
    shard = [list(split_range(batch.n_seqs, layout.dp_size, layout.dp_rank))]
    plan = agree_on_micro_batches(batch, shard, cfg)[0]
    stats = Stats(["nll", "tokens"], [])
    for j, mb in enumerate(plan.micro_batches):
        beat(f"eval mb {j + 1}/{len(plan.micro_batches)}")
        if not mb:
            empty_forward(model, layout)
            continue
        seqs = [shard[0][i] for i in mb]
        logp, _, t = forward_logprobs(model, batch, seqs, 1.0, layout, entropy=False)
        mask = t["loss_mask"].bool()
        stats.add("nll", -(logp * mask).sum())
        stats.add("tokens", float(mask.sum()))
    out = stats.reduce(layout.stats_group)
    return out["nll"] / max(out["tokens"], 1.0)
