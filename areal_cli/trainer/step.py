"""One trainer step: advantages, proximal logprobs, packed micro-batches, PPO update.

Every rank reads the whole batch (it is small next to the model) and computes the
advantages of every group itself, so no group is ever split across ranks for that. The
batch is then cut into `ppo_n_minibatches` consecutive minibatches (one optimizer step
each); inside a minibatch, rank r takes the r-th contiguous slice of sequences and packs
it into micro-batches of at most `max_tokens_per_mb` tokens.

Loss normalisation: each micro-batch loss is divided by the minibatch's GLOBAL number of
loss tokens (or sequences, for seq_mean), computed identically on every rank from the
full batch, and multiplied by the data-parallel size because FSDP averages gradients
over ranks. So the gradient is the same however the batch is split over ranks and
micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from areal_cli.config.schema import TrainEngineConfig
from areal_cli.trainer import losses
from areal_cli.trainer.batch import RolloutBatch
from areal_cli.trainer.packing import pack_sequences, packed_forward_kwargs, plan_micro_batches


@dataclass
class _Shard:
    """This rank's sequences of one minibatch, packed into micro-batches."""

    micro_batches: list[list[int]]
    padding_fraction: float


def _slice(n: int, parts: int, index: int) -> range:
    size = n // parts
    return range(index * size, (index + 1) * size)


def _forward_logprobs(
    model: nn.Module, batch: RolloutBatch, seqs: list[int], temperature: float
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Packed forward over `seqs`; returns (token logprobs, entropy, packed tensors)."""
    tokens = [batch.sequence(i) for i in seqs]
    packed = pack_sequences([t["input_ids"] for t in tokens])
    device = next(model.parameters()).device
    kwargs = {
        k: v.to(device) if torch.is_tensor(v) else v
        for k, v in packed_forward_kwargs(packed).items()
    }
    logits = model(**kwargs).logits[0].float()
    logp = losses.token_logprobs(
        logits, kwargs["input_ids"][0], temperature, packed.cu_seqlens.to(device)
    )
    with torch.no_grad():
        entropy = losses.entropy_from_logits(logits.detach(), temperature)
    cat = {
        k: torch.cat([t[k] for t in tokens]).to(device)
        for k in ("loss_mask", "logprobs", "versions")
    }
    cat["seq_ids"] = packed.seq_ids.to(device)
    return logp, entropy, cat


def seq_advantages(batch: RolloutBatch, cfg: TrainEngineConfig) -> torch.Tensor:
    """Per-sequence advantages of the whole batch (given, or from rewards)."""
    if batch.advantages is not None:
        return batch.advantages.float()
    return losses.compute_advantages(
        batch.rewards.float(),
        batch.group_size,
        cfg.adv_estimator,
        reward_scaling=cfg.reward_scaling,
        reward_bias=cfg.reward_bias,
    )


class _Stats:
    """Sums that are all-reduced once at the end of the step."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def max(self, key: str, value: float) -> None:
        self.maxes[key] = max(self.maxes.get(key, -math.inf), float(value))

    def reduce(self) -> dict[str, float]:
        keys = sorted(self.sums)
        sums = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64)
        mkeys = sorted(self.maxes)
        maxes = torch.tensor([self.maxes[k] for k in mkeys], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(sums)
            if len(mkeys):
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        out = dict(zip(keys, sums.tolist(), strict=True))
        out.update(zip(mkeys, maxes.tolist(), strict=True))
        return out


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    batch: RolloutBatch,
    cfg: TrainEngineConfig,
    temperature: float,
    ref_model: nn.Module | None = None,
) -> dict[str, float]:
    """Run one PPO step on `batch` (collective over the data-parallel ranks).

    `ref_model` (frozen, same sharding) is required when `cfg.kl_ctl > 0`.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if batch.n_seqs % (world * cfg.ppo_n_minibatches):
        raise ValueError(
            f"{batch.n_seqs} sequences cannot be split over {world} ranks x {cfg.ppo_n_minibatches} minibatches"
        )
    if cfg.kl_ctl > 0 and ref_model is None:
        raise ValueError("actor.kl_ctl > 0 needs a reference model")
    temperature = temperature if temperature > 0 else 1.0
    adv_seq = seq_advantages(batch, cfg)
    n_minibatches = cfg.ppo_n_minibatches
    stats = _Stats()
    minibatches = [list(_slice(batch.n_seqs, n_minibatches, m)) for m in range(n_minibatches)]
    shards = [[mb[i] for i in _slice(len(mb), world, rank)] for mb in minibatches]
    plans = [_plan(batch, shard, cfg) for shard in shards]
    prox = (
        _no_grad_logprobs(model, batch, shards, plans, temperature)
        if cfg.use_decoupled_loss
        else None
    )
    ref = (
        _no_grad_logprobs(ref_model, batch, shards, plans, temperature) if cfg.kl_ctl > 0 else None
    )
    grad_norms = []
    for m, (minibatch, shard, plan) in enumerate(zip(minibatches, shards, plans, strict=True)):
        normalizer = _global_normalizer(batch, minibatch, cfg.loss_agg_mode)
        for j, mb in enumerate(plan.micro_batches):
            seqs = [shard[i] for i in mb]
            logp, entropy, t = _forward_logprobs(model, batch, seqs, temperature)
            mask = t["loss_mask"].bool()
            adv = losses.broadcast_to_tokens(adv_seq[seqs].to(logp.device), mask, t["seq_ids"])
            if prox is not None:
                loss_tok, lstats = losses.decoupled_ppo_loss(
                    logp,
                    prox[m][j],
                    t["logprobs"],
                    adv,
                    mask,
                    eps_clip=cfg.eps_clip,
                    eps_clip_higher=cfg.eps_clip_higher,
                    behav_imp_weight_cap=cfg.behav_imp_weight_cap,
                )
            else:
                loss_tok, lstats = losses.ppo_policy_loss(
                    logp,
                    t["logprobs"],
                    adv,
                    mask,
                    eps_clip=cfg.eps_clip,
                    eps_clip_higher=cfg.eps_clip_higher,
                )
            if ref is not None:
                kl = losses.kl_penalty(logp, ref[m][j], mask, cfg.kl_ctl, cfg.kl_estimator)
                loss_tok = loss_tok + kl
                stats.add("kl_sum", (kl.detach() / cfg.kl_ctl).sum())
            loss = losses.aggregate_loss(
                loss_tok, mask, normalizer, cfg.loss_agg_mode, t["seq_ids"]
            )
            (loss * world).backward()
            _record(stats, loss, lstats, entropy, mask, t)
        grad_norms.append(_optimizer_step(model, optimizer, cfg.optimizer.gradient_clipping))
        if scheduler is not None:
            scheduler.step()
    for plan in plans:
        stats.add("padding_fraction_sum", plan.padding_fraction)
    out = stats.reduce()
    return _finish_stats(out, grad_norms, batch, world, n_minibatches, optimizer)


def _plan(batch: RolloutBatch, shard: list[int], cfg: TrainEngineConfig) -> _Shard:
    lengths = [int(batch.seqlens[i]) for i in shard]
    plan = plan_micro_batches(lengths, cfg.mb_spec.max_tokens_per_mb, cfg.mb_spec.n_mbs)
    return _Shard(plan.mbs, plan.padding_fraction)


@torch.no_grad()
def _no_grad_logprobs(model, batch, shards, plans, temperature) -> list[list[torch.Tensor]]:
    """Logprobs of every micro-batch under `model` as it is now: the proximal policy
    (current weights before this step's update, for decoupled PPO) or the reference."""
    out = []
    for shard, plan in zip(shards, plans, strict=True):
        out.append(
            [
                _forward_logprobs(model, batch, [shard[i] for i in mb], temperature)[0]
                for mb in plan.micro_batches
            ]
        )
    return out


def _global_normalizer(batch: RolloutBatch, seqs: list[int], mode: str) -> int:
    masks = [batch.sequence(i)["loss_mask"] for i in seqs]
    return max(1, losses.loss_normalizer(masks, mode))


def _record(stats: _Stats, loss, lstats: dict, entropy, mask, t: dict) -> None:
    n_tok = float(mask.sum())
    stats.add("loss", loss.detach())
    stats.add("loss_tokens", n_tok)
    stats.add("tokens", float(len(mask)))
    stats.add("entropy_sum", (entropy * mask).sum())
    stats.add("clip_frac_sum", lstats["clip_frac"] * n_tok)
    if "imp_weight_mean" in lstats:
        stats.add("imp_weight_sum", lstats["imp_weight_mean"] * n_tok)
        stats.max("imp_weight_max", lstats["imp_weight_max"])
    stats.add("behav_logprob_sum", (t["logprobs"] * mask).sum())


def _optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, clip: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = clip if clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def _finish_stats(out, grad_norms, batch, world, n_minibatches, optimizer) -> dict[str, float]:
    loss_tokens = max(out.pop("loss_tokens"), 1.0)
    result = {
        "loss": out.pop("loss"),
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "clip_frac": out.pop("clip_frac_sum") / loss_tokens,
        "entropy": out.pop("entropy_sum") / loss_tokens,
        "behav_logprob_mean": out.pop("behav_logprob_sum") / loss_tokens,
        "tokens": out.pop("tokens"),
        "loss_tokens": loss_tokens,
        "padding_fraction": out.pop("padding_fraction_sum") / (world * n_minibatches),
        "reward_mean": float(batch.rewards.mean()),
        "lr": optimizer.param_groups[0]["lr"],
    }
    if "kl_sum" in out:
        result["kl"] = out.pop("kl_sum") / loss_tokens
    if "imp_weight_sum" in out:
        result["imp_weight_mean"] = out.pop("imp_weight_sum") / loss_tokens
        result["imp_weight_max"] = out.pop("imp_weight_max")
    return result
