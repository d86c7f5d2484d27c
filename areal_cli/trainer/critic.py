"""The PPO critic (`algorithm: ppo`): a value model beside the actor, and GAE.

The critic is a scalar-head model (areal_cli.models.scalar_head) built from
`critic.path`, or from the body of `model.path` with a new head (written once to
RUN/model-critic). It is sharded on the actor's mesh (the same torchrun ranks), has its
own optimizer (actor.optimizer with `critic.lr`) and LR schedule, and is saved in the
actor's recover entry (DCP keys `critic.*`, `critic_optim.*`).

Alignment. The trainer works in label space (`step.label_space`): position p of a packed
sequence carries the label and loss mask of token p+1. The head's output at p is the
value of the prefix up to token p: V(s) of the state in which token p+1 is generated.
So where the loss mask is on, the critic's outputs are V(s_t) of the generated tokens, in
the same places as their logprobs; and the output at a sequence's last position is the
value after its last token, which bootstraps a sequence cut by the length limit. A
sequence whose last token is EOS is terminal and bootstraps 0.

One step (inside step.train_step, collective like the rest of it):
  1. `targets`: a no-grad forward of the critic over every micro-batch of this rank,
     before any update: the same weights version as the proximal logprobs, so a stale
     sample is treated alike by both. Then GAE per sequence (values.gae) with the reward,
     (r + reward_bias) * reward_scaling, on its last generated token: advantages, and the
     returns (advantages + values) that the critic learns. With
     `critic.whiten_advantages` the batch's advantages get mean 0 and std 1 (one
     all-reduce over the data-parallel ranks).
  2. The actor's PPO loss takes these per-token advantages.
  3. `update`, per minibatch after the actor's optimizer step: the clipped value loss
     (values.value_loss) against the returns, the mean over the minibatch's generated
     tokens times `critic.value_loss_coef`, and an optimizer step; `critic.epochs` times
     (the schedule steps once per minibatch, as the actor's does).
Metrics: value_loss, value_clip_frac, explained_variance (1 - Var(returns - values) /
Var(returns), of the step-start values over the batch's generated tokens; 0 when the
returns barely vary), value_mean, return_mean, critic_grad_norm. value_clip_frac is 0 with
one minibatch and one epoch: the critic then steps once per batch, from the very values it
is clipped around.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from areal_cli.config.schema import CriticConfig, ExperimentConfig, TrainEngineConfig
from areal_cli.rundir.batch import RolloutBatch
from areal_cli.trainer import collectives
from areal_cli.trainer.values import gae, value_loss

# sums each step adds to the trainer's Stats (step._stat_keys) when there is a critic
STAT_KEYS = [
    "value_loss",
    "value_clip_sum",
    "value_tokens",
    "ev_n",
    "ev_r",
    "ev_r2",
    "ev_d",
    "ev_d2",
    "value_sum",
]


EV_MIN_VARIANCE = 1e-3  # explained variance is reported as 0 below this variance of returns


@dataclass
class Critic:
    """The critic's sharded model, optimizer and schedule, and the settings they use."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    cfg: CriticConfig
    clip_grad: float  # actor.optimizer.gradient_clipping
    eos_id: int | None
    model_dir: Path  # its config and tokenizer, which its HF exports carry

    # What the actor's step asks of it (step.ValueModel); the step never imports this
    # module, so the critic can use the step's machinery without a cycle.
    stat_keys = STAT_KEYS  # its per-token sums, reduced with the actor's

    def targets(self, batch, shards, plans, cfg, layout, beat, stats) -> list:
        """Old values, advantages and returns for every micro-batch (see `targets`)."""
        return targets(self, batch, shards, plans, cfg, layout, beat, stats)

    def update(self, batch, minibatch, shard, plan, row, layout, beat, stats) -> list[float]:
        """Its optimizer steps on one minibatch (see `update`)."""
        return update(self, batch, minibatch, shard, plan, row, layout, beat, stats)

    def skip_minibatch(self) -> None:
        """A minibatch without sequences: the schedule steps as the actor's does."""
        self.scheduler.step()

    def finish_stats(self, out: dict[str, float], grad_norms: list[float]) -> dict[str, float]:
        """Its figures (see `finish_stats`), and its learning rate now."""
        result = finish_stats(out, grad_norms, len(grad_norms))
        result["critic_lr"] = self.optimizer.param_groups[0]["lr"]
        return result


@dataclass
class Targets:
    """One micro-batch's per-position tensors (label space): old values, advantages,
    returns; 0 where the loss mask is off."""

    mask: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


def build_critic(
    cfg: ExperimentConfig, model_dir: Path, run_dir: Path, mesh: Any, build_optimizer: Any
) -> Critic:
    """The sharded critic on the actor's mesh, with its optimizer from
    `build_optimizer(model, cfg, lr=...)` (the trainer's; collective)."""
    from areal_cli.rundir.paths import RunDir
    from areal_cli.trainer.parallelize import build_sharded_model, scalar_model

    # critic.path when it has a scalar head; else RUN/model-critic: the body of critic.path
    # (or model.path) with a head at zero
    source = Path(cfg.critic.path) if cfg.critic.path else model_dir
    folder = scalar_model(source, RunDir(run_dir).critic_model, cfg.seed, head_std=0.0)
    model = build_sharded_model(
        folder,
        mesh,
        cfg.actor.fsdp,
        dtype=cfg.model.dtype,
        gradient_checkpointing=cfg.actor.gradient_checkpointing,
    )
    optimizer, scheduler = build_optimizer(model, cfg, lr=cfg.critic.lr)
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    return Critic(
        model,
        optimizer,
        scheduler,
        cfg.critic,
        cfg.actor.optimizer.gradient_clipping,
        eos[0] if isinstance(eos, list) else eos,
        folder,
    )


def forward_values(
    model: nn.Module, batch: RolloutBatch, seqs: list[int], layout: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's output at every position of the packed `seqs` (label space; whole
    sequences: algorithm ppo refuses context parallelism), and the packed tensors."""
    from areal_cli.trainer.packing import to_device
    from areal_cli.trainer.step import label_space

    mb = label_space([batch.sequence(i) for i in seqs])
    device = next(model.parameters()).device
    local = {k: to_device(v, device) for k, v in mb.items()}
    with layout.attention.micro_batch(layout.cp_group, layout.cp_size, mb["seq_ids"], device):
        values = model(
            input_ids=local["input_ids"][None],
            position_ids=local["position_ids"][None],
            use_cache=False,
        )[0].float()
    return values, local


def sequence_targets(
    values: torch.Tensor,
    t: dict[str, torch.Tensor],
    rewards: torch.Tensor,
    ended: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE of every packed sequence of a micro-batch: (advantages, returns) per position,
    0 off the loss mask. `rewards[k]` and `ended[k]` belong to the micro-batch's k-th
    sequence; the reward sits on its last generated token."""
    mask = t["loss_mask"].bool()
    n = len(rewards)
    spans = []
    for k in range(n):
        where = (t["seq_ids"] == k).nonzero().squeeze(1)
        spans.append((where, where[mask[where]]))
    width = max([1, *(len(gen) for _, gen in spans)])
    v = values.new_zeros(n, width)
    r = values.new_zeros(n, width)
    m = torch.zeros(n, width, dtype=torch.bool, device=values.device)
    last = values.new_zeros(n)
    for k, (where, gen) in enumerate(spans):
        v[k, : len(gen)] = values[gen]
        m[k, : len(gen)] = True
        if len(gen):
            r[k, len(gen) - 1] = rewards[k]
        last[k] = values[where[-1]]
    adv, ret = gae(v, r, m, last, ended.to(values.device), gamma, lam)
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    for k, (_, gen) in enumerate(spans):
        advantages[gen] = adv[k, : len(gen)]
        returns[gen] = ret[k, : len(gen)]
    return advantages, returns


@torch.no_grad()
def targets(
    critic: Critic,
    batch: RolloutBatch,
    shards: list[list[int]],
    plans: list[Any],
    cfg: TrainEngineConfig,
    layout: Any,
    beat: Any,
    stats: Any,
) -> list[list[Targets | None]]:
    """Step 1 of the module docstring, for every micro-batch of this rank."""
    from areal_cli.trainer.step import empty_forward

    rewards = (batch.rewards.float() + cfg.reward_bias) * cfg.reward_scaling
    out: list[list[Targets | None]] = []
    for shard, plan in zip(shards, plans, strict=True):
        row: list[Targets | None] = []
        for j, mb in enumerate(plan.micro_batches):
            beat(f"critic values mb {j + 1}/{len(plan.micro_batches)}")
            if not mb:
                empty_forward(critic.model, layout)
                row.append(None)
                continue
            seqs = [shard[i] for i in mb]
            values, t = forward_values(critic.model, batch, seqs, layout)
            ended = torch.tensor(
                [int(batch.sequence(i)["input_ids"][-1]) == critic.eos_id for i in seqs]
            )
            adv, ret = sequence_targets(
                values, t, rewards[seqs].to(values.device), ended, critic.cfg.gamma, critic.cfg.lam
            )
            mask = t["loss_mask"].bool()
            values = values * mask
            _explained_variance_sums(stats, values, ret, mask)
            row.append(Targets(mask, values, adv, ret))
        out.append(row)
    if critic.cfg.whiten_advantages:
        _whiten(out, layout)
    return out


def _explained_variance_sums(stats: Any, values, returns, mask) -> None:
    d = (returns - values)[mask].double()
    r = returns[mask].double()
    stats.add("ev_n", float(mask.sum()))
    stats.add("ev_r", r.sum())
    stats.add("ev_r2", (r * r).sum())
    stats.add("ev_d", d.sum())
    stats.add("ev_d2", (d * d).sum())
    stats.add("value_sum", values[mask].double().sum())


def _whiten(targets: list[list[Targets | None]], layout: Any) -> None:
    """Advantages to mean 0 and std 1 over the whole batch's generated tokens."""
    count, total, squares = 0.0, 0.0, 0.0  # floats, or 0-d tensors on the model's device
    for row in targets:
        for tg in row:
            if tg is not None:
                a = tg.advantages[tg.mask].double()
                count, total, squares = count + a.numel(), total + a.sum(), squares + (a * a).sum()
    n, total, squares = collectives.reduce_values(
        [count, total, squares], "sum", layout.stats_group
    )
    if n == 0:
        return
    mean = total / n
    std = max(squares / n - mean * mean, 0.0) ** 0.5
    for row in targets:
        for tg in row:
            if tg is not None:
                tg.advantages = torch.where(
                    tg.mask, (tg.advantages - mean) / (std + 1e-8), torch.zeros_like(tg.advantages)
                )


def update(
    critic: Critic,
    batch: RolloutBatch,
    minibatch: list[int],
    shard: list[int],
    plan: Any,
    row: list[Targets | None],
    layout: Any,
    beat: Any,
    stats: Any,
) -> list[float]:
    """Step 3 of the module docstring for one minibatch: `critic.epochs` optimizer steps,
    each over all its micro-batches, then one step of the schedule; returns the grad norms."""
    from areal_cli.trainer.step import empty_forward, global_normalizer, optimizer_step

    normalizer = global_normalizer(batch, minibatch, "token_mean")
    eps = critic.cfg.value_eps_clip or None
    norms = []
    for epoch in range(critic.cfg.epochs):
        of = f" epoch {epoch + 1}/{critic.cfg.epochs}" if critic.cfg.epochs > 1 else ""
        for j, mb in enumerate(plan.micro_batches):
            beat(f"critic mb {j + 1}/{len(plan.micro_batches)}{of}")
            tg = row[j]
            if not mb or tg is None:
                (empty_forward(critic.model, layout) * layout.data_world).backward()
                continue
            values, _ = forward_values(critic.model, batch, [shard[i] for i in mb], layout)
            per_token, vstats = value_loss(values, tg.values, tg.returns, tg.mask, eps)
            loss = per_token.sum() / normalizer
            (loss * critic.cfg.value_loss_coef * layout.data_world).backward()
            n_tok = float(tg.mask.sum())
            stats.add("value_loss", loss.detach())
            stats.add("value_clip_sum", vstats["value_clip_frac"] * n_tok)
            stats.add("value_tokens", n_tok)
        beat("critic optimizer step" + of)
        norms.append(optimizer_step(critic.model, critic.optimizer, critic.clip_grad))
    critic.scheduler.step()
    return norms


def finish_stats(out: dict[str, float], grad_norms: list[float], n_updates: int) -> dict:
    """The critic's metrics from the reduced sums (see STAT_KEYS); `n_updates`: the
    critic's optimizer steps this step (value_loss is their mean)."""
    n = max(out.pop("ev_n"), 1.0)
    r_mean, d_mean = out.pop("ev_r") / n, out.pop("ev_d") / n
    var_r = out.pop("ev_r2") / n - r_mean**2
    var_d = out.pop("ev_d2") / n - d_mean**2
    value_tokens = max(out.pop("value_tokens"), 1.0)
    return {
        "value_loss": out.pop("value_loss") / max(n_updates, 1),
        "value_clip_frac": out.pop("value_clip_sum") / value_tokens,
        # 0 when the returns barely vary (a batch scored alike): the ratio means nothing there
        "explained_variance": 1.0 - var_d / var_r if var_r > EV_MIN_VARIANCE else 0.0,
        "value_mean": out.pop("value_sum") / n,
        "return_mean": r_mean,
        "critic_grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
    }
