"""Per-sequence advantages from scalar rewards: shaping, then two normalisations.

A sequence's reward `r` becomes its advantage in these stages, each optional (the order
is AReaL's):

  0. overlong penalty (DAPO), for a sequence of L generated tokens, with Lmax
     max_new_tokens and B overlong_tokens: r += min(0, -(L - (Lmax - B)) / B * factor),
     from 0 at Lmax - B down to -factor at Lmax
  1. shaping   x = clip((r + reward_bias) * reward_scaling, -reward_clip, reward_clip)
  2. reward_norm, over sequences (each weighs 1)
  3. mask_no_eos_with_zero: a sequence cut at max_new_tokens (no EOS) gets 0 here
  4. adv_norm, over trained tokens (a sequence weighs its number of trained tokens,
     as when the advantage is whitened token by token)

A normalisation (`Norm`) subtracts a mean and divides by a standard deviation, each at a
level of its own: `group` (the sequences of one prompt: `group_size` consecutive ones, or
those sharing a group id when groups differ in size, as an agent's do), `batch`
(the whole global batch: every rank holds it, so no collective is needed) or `none`.

  mean   m_i = sum_j w_j x_j / sum_j w_j over i's group or the batch; with leave-one-out,
         over the others only: m_i = (sum_j w_j x_j - w_i x_i) / (sum_j w_j - w_i), and 0
         where i is alone
  std    s_i = sqrt(sum_j w_j (x_j - m_j)^2 / (W - 1 if unbiased else W)) over the std's
         level, W = sum_j w_j, around the means of step "mean" (around 0 when the mean
         level is none); taken as 1 when its level is none
  out    (x_i - m_i) / (s_i + eps), with eps 0 when the std level is none

These are AReaL's `reward_norm` and `adv_norm` (NormConfig), with one difference: AReaL
leaves one *token* out of a token-level mean, areal one *sequence*.

The named estimators are presets of reward_norm (no adv_norm), in float64:
  grpo          mean group, std group (population)          A = (r - mu_g) / (sigma_g + eps)
  dr_grpo       mean group                                  A = r - mu_g
  rloo          mean group, leave-one-out                   A = G / (G - 1) * (r - mu_g)
  reinforce_pp  mean group, std batch (population)          A = (r - mu_g) / (sigma_b + eps)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Level = Literal["group", "batch", "none"]


@dataclass(frozen=True)
class Norm:
    """One normalisation: see the module docstring."""

    mean_level: Level = "none"
    std_level: Level = "none"
    leave_one_out: bool = False
    unbiased: bool = False
    eps: float = 1e-6

    @property
    def is_identity(self) -> bool:
        return self.mean_level == "none" and self.std_level == "none"


PRESETS: dict[str, Norm] = {
    "grpo": Norm("group", "group"),
    "dr_grpo": Norm("group", "none"),
    "rloo": Norm("group", "none", leave_one_out=True),
    "reinforce_pp": Norm("group", "batch"),
}


@dataclass(frozen=True)
class Overlong:
    """The overlong penalty: see stage 0 of the module docstring."""

    max_new_tokens: int
    overlong_tokens: int
    factor: float

    def penalty(self, lengths: torch.Tensor) -> torch.Tensor:
        """The (non-positive) penalty of sequences of `lengths` generated tokens."""
        over = lengths.to(torch.float64) - (self.max_new_tokens - self.overlong_tokens)
        return (-over / self.overlong_tokens * self.factor).clamp(max=0.0)


def shape_rewards(
    rewards: torch.Tensor, scaling: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> torch.Tensor:
    """(r + bias) * scaling, clipped to [-clip, clip] when `clip` is set; float64."""
    x = (rewards.detach().double() + bias) * scaling  # no copy when already float64
    return x if clip is None else x.clamp(-clip, clip)


def _sums(values: torch.Tensor, level: str, groups: int | torch.Tensor) -> torch.Tensor:
    """Each element's group (or batch) sum, broadcast back to [N]."""
    if level == "batch":
        return values.sum().expand_as(values)
    if isinstance(groups, int):
        return values.view(-1, groups).sum(1, keepdim=True).expand(-1, groups).reshape(-1)
    totals = torch.zeros(int(groups.max()) + 1, dtype=values.dtype)
    return totals.index_add_(0, groups, values)[groups]


def _check_groups(n: int, groups: int | torch.Tensor) -> None:
    if isinstance(groups, int):
        if groups < 1 or n % groups:
            raise ValueError(f"{n} values are not divisible into groups of {groups}")
    elif groups.shape != (n,) or groups.dtype != torch.int64 or (n and int(groups.min()) < 0):
        raise ValueError(f"group ids must be {n} non-negative int64 values, one per sequence")


def normalize(
    x: torch.Tensor, groups: int | torch.Tensor, norm: Norm, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """`norm` applied to per-sequence values `x` [N] (float64), `weights` [N] (default 1),
    over `groups` (a group size, or each sequence's group id)."""
    if x.dim() != 1:
        raise ValueError(f"values must be 1-D [N], got shape {tuple(x.shape)}")
    _check_groups(x.numel(), groups)
    x = x.to(torch.float64)
    w = torch.ones_like(x) if weights is None else weights.to(torch.float64)
    if norm.mean_level == "none":
        mean = torch.zeros_like(x)
    else:
        total, count = (
            _sums(w * x, norm.mean_level, groups),
            _sums(w, norm.mean_level, groups),
        )
        if norm.leave_one_out:
            rest = count - w
            mean = torch.where(rest > 0, (total - w * x) / rest.clamp(min=1e-300), 0.0)
        else:
            mean = torch.where(count > 0, total / count.clamp(min=1e-300), 0.0)
    centred = x - mean
    if norm.std_level == "none":
        return centred
    sq = _sums(w * centred**2, norm.std_level, groups)
    count = _sums(w, norm.std_level, groups) - (1.0 if norm.unbiased else 0.0)
    std = torch.where(count > 0, sq / count.clamp(min=1e-300), 0.0).sqrt()
    return centred / (std + norm.eps)


def advantages(
    rewards: torch.Tensor,
    groups: int | torch.Tensor,
    reward_norm: Norm,
    adv_norm: Norm = Norm(),
    trained_tokens: torch.Tensor | None = None,
    scaling: float = 1.0,
    bias: float = 0.0,
    clip: float | None = None,
    overlong: Overlong | None = None,
    zero_if: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence advantages [N] (float32) by the stages of the module docstring:
    `overlong` penalises by `trained_tokens` (each sequence's generated tokens), shaping,
    reward_norm, `zero_if` (bool [N], mask_no_eos_with_zero's truncated sequences) set to
    0, then adv_norm weighted by `trained_tokens` (default 1 each)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    r = rewards.detach().to(torch.float64)
    if overlong is not None:
        if trained_tokens is None:
            raise ValueError("the overlong penalty needs each sequence's generated tokens")
        r = r + overlong.penalty(trained_tokens)
    x = normalize(shape_rewards(r, scaling, bias, clip), groups, reward_norm)
    if zero_if is not None:
        x = torch.where(zero_if.bool(), 0.0, x)
    if not adv_norm.is_identity:
        x = normalize(x, groups, adv_norm, trained_tokens)
    return x.to(torch.float32)
