"""Value-based advantages for PPO with a critic: GAE and the clipped value loss.

Shapes are padded batches [B, T] over each sequence's response tokens (T = the longest
response), with `mask` [B, T] marking real tokens; a sequence's tokens are its first
`mask[b].sum()` positions.

  values[b, t]   the critic's V(s_t): the state before response token t is generated
  rewards[b, t]  per-token rewards (the task reward on the last token, plus any per-token
                 penalty such as KL)
  last_value[b]  V(s_T), the state after the last token: the bootstrap of a sequence
                 that stopped at the length limit. A sequence that ended with EOS is
                 terminal and bootstraps 0 (`ended[b]`).

GAE (Schulman et al. 2016):
  delta_t = r_t + gamma * V(s_{t+1}) - V(s_t),   V(s_T) = 0 if ended else last_value
  A_t     = delta_t + gamma * lam * A_{t+1},     A_T = 0
  return_t = A_t + V(s_t)  (the value target)

The value loss clips the new value around the value at rollout time, as PPO does
(`eps_value`), takes the larger of the two squared errors, and halves it.
"""

from __future__ import annotations

import torch


def gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    last_value: torch.Tensor,
    ended: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] and 0 off the mask. See the module docstring."""
    if values.shape != rewards.shape or values.shape != mask.shape:
        raise ValueError(f"values, rewards and mask differ in shape: {values.shape}")
    mask = mask.to(values.dtype)
    lengths = mask.sum(-1).long()
    batch, width = values.shape
    rows = torch.arange(batch)
    # V(s_{t+1}) for every t: the next position's value inside the sequence, the bootstrap
    # after its last token
    bootstrap = torch.where(ended.bool(), torch.zeros_like(last_value), last_value)
    next_values = torch.cat([values[:, 1:], values.new_zeros(batch, 1)], dim=1) * mask
    last = (lengths - 1).clamp(min=0)
    next_values[rows, last] = torch.where(lengths > 0, bootstrap, next_values[rows, last])
    deltas = (rewards + gamma * next_values - values) * mask
    advantages = torch.zeros_like(values)
    running = values.new_zeros(batch)
    for t in reversed(range(width)):
        running = deltas[:, t] + gamma * lam * running * mask[:, t]
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def value_loss(
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    eps_value: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), 0 off the mask,
    and the fraction of tokens where the clipped term was the larger (`value_clip_frac`).
    `eps_value` None: no clipping."""
    unclipped = (new_values - returns) ** 2
    if eps_value is None:
        loss, clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        held = old_values + (new_values - old_values).clamp(-eps_value, eps_value)
        other = (held - returns) ** 2
        loss, clipped = torch.maximum(unclipped, other), other > unclipped
    on = mask.bool()
    n = max(int(on.sum()), 1)
    return 0.5 * loss * on, {"value_clip_frac": float((clipped & on).sum()) / n}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens (1: perfect, 0: no better than the
    mean, below 0: worse); 0 when the returns do not vary."""
    on = mask.bool()
    r, v = returns[on].double(), values[on].double()
    var = r.var(unbiased=False)
    if r.numel() < 2 or float(var) == 0.0:
        return 0.0
    return float(1.0 - (r - v).var(unbiased=False) / var)
