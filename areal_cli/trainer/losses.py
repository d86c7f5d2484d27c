"""RL losses for policy training: advantages, (decoupled) PPO, KL penalty, aggregation.

Tensor conventions
------------------
* Per-token functions are elementwise, so they accept either layout:
  - packed: 1-D ``[T]`` tensors, several sequences concatenated, with ``seq_ids[t]`` = index
    (0..n-1, local to the micro-batch) of the sequence token ``t`` belongs to;
  - padded: ``[B, S]`` tensors, row ``b`` is sequence ``b`` (``seq_ids`` may then be omitted).
* ``loss_mask`` is 1 (or True) on generated tokens that are trained, 0 elsewhere (prompt, padding).
  Values at masked-out positions are ignored and may be garbage (even ``inf``/``nan`` logprobs):
  they are replaced before any ``exp`` so they cannot leak NaNs into values or gradients.
* Logprobs are *token-aligned*: ``logp[t] = log p(token[t] | tokens[<t])``, so the loss mask,
  the inference server's behaviour logprobs and the trainer's logprobs all index the same token.
  :func:`token_logprobs` produces this alignment from model logits.
* Stats are detached 0-d tensors (ready for all-reduce), 0 when the mask is empty.
* Per-token losses returned here are already zero outside the mask; reduce them with
  :func:`aggregate_loss` and a global normalizer from :func:`loss_normalizer`.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

import torch

from areal_cli.trainer import collectives
from areal_cli.trainer.advantages import PRESETS, advantages

AdvEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
KLEstimator = Literal["k1", "k2", "k3"]
LossAggMode = Literal["token_mean", "seq_mean"]
Stats = dict[str, torch.Tensor]

ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
LOSS_AGG_MODES: tuple[str, ...] = ("token_mean", "seq_mean")


# ----------------------------------------------------------------------------- helpers


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * m) / max(sum(m), 1), detached; 0 for an empty mask."""
    m = mask.bool()
    x = x.detach()
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max of x over the mask, detached; 0 for an empty mask. No host sync: nothing
    here depends on how many positions the mask holds."""
    m = mask.bool()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return zero
    x = x.detach()
    top = torch.where(m, x, torch.full_like(x, -math.inf)).max()
    return torch.where(m.any(), top, zero)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32 for numerically safe softmax; fp32/fp64 unchanged."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _resolve_seq_ids(mask: torch.Tensor, seq_ids: torch.Tensor | None) -> torch.Tensor:
    """Sequence index per token; padded [B, S] layouts default to the row index."""
    if seq_ids is not None:
        if seq_ids.shape != mask.shape:
            raise ValueError(f"seq_ids shape {tuple(seq_ids.shape)} != mask {tuple(mask.shape)}")
        return seq_ids.long()
    if mask.dim() != 2:
        raise ValueError("seq_ids is required for packed (non-[B, S]) tensors")
    rows = torch.arange(mask.shape[0], device=mask.device)
    return rows.unsqueeze(-1).expand_as(mask)


# ----------------------------------------------------------------------------- advantages


def compute_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: AdvEstimator = "grpo",
    reward_scaling: float = 1.0,
    reward_bias: float = 0.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sequence advantages from scalar rewards ``[N]`` by a named estimator;
    ``group_size`` consecutive samples share a prompt.

    Rewards are first transformed as ``r' = (r + reward_bias) * reward_scaling``. Then, per
    group g with mean ``mu_g`` and *population* std ``sigma_g`` (a group of identical
    rewards gives advantage 0, never NaN):

    * ``grpo``:         ``A = (r - mu_g) / (sigma_g + eps)``
    * ``dr_grpo``:      ``A = r - mu_g``  (Dr. GRPO: no std division)
    * ``rloo``:         ``A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mu_g)``  (G >= 2)
    * ``reinforce_pp``: ``A = (r - mu_g) / (sigma_batch + eps)`` with ``sigma_batch`` the
      population std of the group-centred values over all N samples (REINFORCE++ with
      group baseline). Pass the *global* batch.

    Each is a preset of `areal_cli.trainer.advantages` (its docstring has the general form).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards are not divisible into groups of {group_size}")
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator {estimator!r}; choose from {ADV_ESTIMATORS}")
    if estimator == "rloo" and group_size < 2:
        raise ValueError("rloo needs group_size >= 2 (leave-one-out baseline)")
    norm = replace(PRESETS[estimator], eps=eps)
    return advantages(rewards, group_size, norm, scaling=reward_scaling, bias=reward_bias)


def broadcast_to_tokens(
    seq_values: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token tensor ``v[t] = seq_values[seq_ids[t]] * loss_mask[t]`` (padded: ``v[b, s] = seq_values[b] * m[b, s]``)."""
    ids = _resolve_seq_ids(loss_mask, seq_ids)
    vals = seq_values.to(ids.device)[ids]
    return torch.where(loss_mask.bool(), vals, torch.zeros_like(vals))


# ----------------------------------------------------------------------------- PPO


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Clipped PPO surrogate per token.

    ``ratio = exp(logp - old_logp)``,
    ``loss = -min(ratio * A, clip(ratio, 1 - eps_clip, 1 + eps_clip_higher) * A)``;
    ``eps_clip_higher`` defaults to ``eps_clip`` (DAPO decoupled clip when larger).
    Dual clip (Ye et al. 2020), with ``c_clip`` > 1: where ``A < 0`` the loss is at most
    ``-c_clip * A``, so a token whose ratio has run far above 1 cannot dominate.
    With ``seq_ids`` the ratio is GSPO's sequence-level one (Zheng et al. 2025): every
    token of sequence i takes ``exp(mean over i's masked tokens of (logp - old_logp))``,
    which carries the gradient of all of them (each sequence must be whole here).
    Stats over masked tokens: ``clip_frac`` (the clipped branch is strictly the active one, i.e.
    the token gets no gradient), ``ratio_mean``, ``ratio_max``, and with ``c_clip``
    ``dual_clip_frac`` (the cap is strictly the active branch).
    """
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    m = loss_mask.bool()
    ratio = _ratio(logp, old_logp, m, seq_ids)
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    stats: Stats = {
        "clip_frac": _masked_mean((clipped > unclipped).to(ratio.dtype), m),
        "ratio_mean": _masked_mean(ratio, m),
        "ratio_max": _masked_max(ratio, m),
    }
    if c_clip is not None:
        cap = -adv * c_clip
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        stats["dual_clip_frac"] = _masked_mean(capped.to(ratio.dtype), m)
    return torch.where(m, loss, torch.zeros_like(loss)), stats


def sapo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """SAPO, Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv 2511.20347): PPO's
    hard clip replaced by a smooth gate of the ratio.

    ``r = exp(logp - old_logp)`` (with ``seq_ids``, the sequence-level ratio as in
    :func:`ppo_policy_loss`), ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``,
    ``loss = -(4 / tau) * sigmoid(tau * (r - 1)) * A``. The gate's slope at ``r = 1`` is
    1, so an on-policy token gets the policy gradient; far from 1 the gradient fades
    instead of stopping, faster for negative advantages (``tau_neg > tau_pos``). Stats:
    ``ratio_mean``, ``ratio_max``, ``clip_frac`` 0 (nothing is clipped) and ``gate_mean``,
    the mean of ``sigmoid`` (0.5 on policy).
    """
    m = loss_mask.bool()
    ratio = _ratio(logp, old_logp, m, seq_ids)
    adv = advantages.detach()
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * adv
    stats: Stats = {
        "clip_frac": _masked_mean(torch.zeros_like(ratio), m),
        "ratio_mean": _masked_mean(ratio, m),
        "ratio_max": _masked_max(ratio, m),
        "gate_mean": _masked_mean(gate, m),
    }
    return torch.where(m, loss, torch.zeros_like(loss)), stats


def m2_cutoff(m2: torch.Tensor, threshold: float) -> float:
    """M2PO's filter (Zheng et al. 2025, arXiv 2510.01161) over the second moments
    ``m2 = (log prox - log behav)^2`` of every trained token of a minibatch (all ranks):
    drop the largest, one by one, until the mean of the rest is below `threshold`.
    Returns the bound: a token is kept when its ``m2 <= bound`` (``inf``: keep all). At
    least one token is kept, and tokens tied with the largest kept one are kept with it,
    so the result does not depend on the order the tokens came in (ranks, micro-batches)."""
    values = m2.detach().double().reshape(-1)
    if values.numel() == 0 or float(values.mean()) < threshold:
        return math.inf
    ordered = values.sort(descending=True).values
    n = ordered.numel()
    rest_mean = ordered.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=ordered.dtype)
    below = torch.nonzero(rest_mean < threshold)
    dropped = int(below[0]) if below.numel() else n - 1  # keep the smallest at least
    return float(ordered[dropped])


def _ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor | None
) -> torch.Tensor:
    """exp(logp - old_logp) per token, or with `seq_ids` each sequence's geometric mean
    (GSPO). Masked-out positions may hold garbage: a zero log-ratio keeps exp() finite."""
    log_ratio = torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp))
    if seq_ids is not None:
        log_ratio = _sequence_mean(log_ratio, mask, seq_ids)
    return torch.exp(log_ratio)


def _slots(ids: torch.Tensor) -> int:
    """How many per-sequence slots the sequence ids of packed tokens need, without reading
    them (a host sync on a GPU): ids number the sequences from 0 and every sequence has a
    token, so no id reaches the token count. Unused slots stay empty."""
    return ids.numel()


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sequence's mean of `x` over its masked tokens (0 off the mask)."""
    ids = seq_ids.long().reshape(-1)
    n_seq = _slots(ids)
    flat = torch.where(mask, x, torch.zeros_like(x)).reshape(-1)
    sums = flat.new_zeros(n_seq).index_add(0, ids, flat)
    counts = flat.new_zeros(n_seq).index_add(0, ids, mask.reshape(-1).to(flat.dtype))
    means = (sums / counts.clamp(min=1))[ids].reshape(x.shape)
    return torch.where(mask, means, torch.zeros_like(means))


@dataclass(frozen=True)
class Rejection:
    """actor.rejection_sampling as the decoupled loss reads it (AReaL's RejectionSamplingConfig):
    which tokens whose proximal policy has moved far from the behaviour policy are
    filtered. ``upper`` and ``lower`` None together: no filter."""

    level: str = "token"  # token, or sequence: every token of a sequence shares its fate
    action: str = "mask"  # mask: drop them; clamp: bound their importance weight
    metric: str = "ratio"  # ratio (prox/behav) or kl_k1, kl_k2, kl_k3 (estimators of it)
    agg: str = "mean"  # sequence level: sum, mean or max over the sequence's tokens
    upper: float | None = 5.0
    lower: float | None = None

    @property
    def active(self) -> bool:
        return self.upper is not None or self.lower is not None


def _in_bounds(x: torch.Tensor, rule: Rejection) -> torch.Tensor:
    ok = torch.ones_like(x, dtype=torch.bool)
    if rule.upper is not None:
        ok &= x <= rule.upper
    if rule.lower is not None:
        ok &= x >= rule.lower
    return ok


def _sequence_agg(
    x: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, agg: str
) -> torch.Tensor:
    """Each token's sequence's sum, mean or max of `x` over its masked tokens (0 for a
    sequence with none)."""
    if agg == "mean":
        return _sequence_mean(x, mask, seq_ids)
    ids = seq_ids.long().reshape(-1)
    n_seq = _slots(ids)
    m = mask.reshape(-1)
    if agg == "sum":
        flat = torch.where(m, x.reshape(-1), torch.zeros_like(x.reshape(-1)))
        per_seq = flat.new_zeros(n_seq).index_add(0, ids, flat)
    elif agg == "max":
        flat = torch.where(m, x.reshape(-1), torch.full_like(x.reshape(-1), -math.inf))
        per_seq = flat.new_full((n_seq,), -math.inf).scatter_reduce(0, ids, flat, "amax")
        per_seq = torch.where(torch.isfinite(per_seq), per_seq, torch.zeros_like(per_seq))
    else:
        raise ValueError(f"unknown sequence aggregation {agg!r}; choose sum, mean or max")
    return per_seq[ids].reshape(x.shape)


def behaviour_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    rule: Rejection | None,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Stats]:
    """The decoupled loss's behaviour importance weights after rejection sampling
    (AReaL's ``apply_rejection_sampling``, docs/en/algorithms: decoupled PPO).

    ``log r = prox_logp - behav_logp`` per token (no grad). The metric is ``r`` (ratio), or
    the KL estimate k1/k2/k3 of ``log r`` (:func:`kl_estimate`). At sequence level the
    metric is aggregated over each sequence's masked tokens (``agg``; for the ratio in
    log space, so mean is the geometric mean), and with the ratio metric every token's
    weight is its sequence's geometric mean ratio. A token (or sequence) is out of bounds
    when its metric is above ``upper`` or below ``lower``. ``mask`` drops it (weight 0,
    still counted by the normalizer); ``clamp`` (ratio only) clamps its weight into
    ``[lower or 0, upper]``. Returns (weights, kept mask, stats): ``imp_weight_mean`` and
    ``imp_weight_max`` over the loss mask before filtering (outliers stay visible),
    ``imp_weight_drop_frac`` (masked share) and ``imp_weight_clamp_frac`` (clamped share),
    and ``behave_approx_kl``, the mean of ``log r`` over the kept tokens.
    """
    m = loss_mask.bool()
    log_r = (prox_logp.detach() - behav_logp.detach()).to(_upcast(prox_logp).dtype)
    log_r = torch.where(m & torch.isfinite(log_r), log_r, torch.zeros_like(log_r))
    rule = rule or Rejection(upper=None)
    sequence = rule.level == "sequence"
    ids = _resolve_seq_ids(loss_mask, seq_ids) if sequence else None
    token_w = torch.exp(log_r)
    w = torch.exp(_sequence_mean(log_r, m, ids)) if sequence and rule.metric == "ratio" else token_w
    keep, clamped = m, torch.zeros_like(m)
    if rule.active:
        if rule.metric == "ratio":  # aggregated in log space
            metric = torch.exp(_sequence_agg(log_r, m, ids, rule.agg)) if sequence else token_w
        else:
            metric = kl_estimate(log_r, torch.zeros_like(log_r), rule.metric.removeprefix("kl_"))
            metric = _sequence_agg(metric, m, ids, rule.agg) if sequence else metric
        inside = _in_bounds(metric, rule)
        if rule.action == "mask":
            keep = m & inside
        else:
            low = rule.lower if rule.lower is not None else 0.0
            high = rule.upper if rule.upper is not None else math.inf
            bounded = w.clamp(min=low, max=high)
            clamped = m & ~inside & (bounded != w)
            w = torch.where(inside, w, bounded)
    stats: Stats = {
        "imp_weight_mean": _masked_mean(token_w, m),
        "imp_weight_max": _masked_max(token_w, m),
        "imp_weight_drop_frac": _masked_mean((m & ~keep).to(w.dtype), m),
        "imp_weight_clamp_frac": _masked_mean(clamped.to(w.dtype), m),
        "behave_approx_kl": _masked_mean(log_r, keep),
    }
    return torch.where(keep, w, torch.zeros_like(w)), keep, stats


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    rejection: Rejection | None = None,
    c_clip: float | None = None,
    seq_ids: torch.Tensor | None = None,
    rejection_seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Decoupled PPO (AReaL): clip against the proximal policy, reweight for the stale behaviour policy.

    ``w`` = the behaviour importance weight ``exp(prox_logp - behav_logp)`` (no grad)
    after rejection sampling (:func:`behaviour_weights`; None: no filter),
    ``loss = w * ppo_loss(logp, prox_logp)``. Dropped tokens have loss 0 and stay in the
    normalizer, which is fixed from the loss mask before the forward pass, as in AReaL.
    ``seq_ids`` turns on GSPO's sequence ratio; ``rejection_seq_ids`` gives the sequences
    of ``rejection.level: sequence``. Clip/ratio stats cover the kept tokens.
    """
    w, keep, wstats = behaviour_weights(
        prox_logp, behav_logp, loss_mask, rejection, rejection_seq_ids
    )
    pg_loss, stats = ppo_policy_loss(
        logp, prox_logp, advantages, keep, eps_clip, eps_clip_higher, c_clip, seq_ids
    )
    stats.update(wstats)
    return pg_loss * w.to(pg_loss.dtype), stats


def _version_alpha(versions: torch.Tensor, version: int) -> torch.Tensor:
    """AReaL's interpolation weight per token: ``(v_prox - v_behave) / (v_theta - v_behave)``
    with ``v_prox = version`` (the weights as the step starts) and ``v_theta = version + 1``
    (the weights the step is making), clamped to [0, 1]; 0 on prompt tokens (version -1)."""
    v = versions.to(torch.float64)
    gap = version + 1.0 - v
    alpha = torch.where((versions >= 0) & (gap > 0), (version - v) / gap.clamp(min=1.0), 0.0)
    return alpha.clamp(0.0, 1.0)


def loglinear_proximal(
    logp: torch.Tensor, behav_logp: torch.Tensor, versions: torch.Tensor, version: int
) -> torch.Tensor:
    """prox_logp_method: loglinear (AReaL, docs/en/algorithms/prox_approx.md): the proximal
    logprobs without their forward pass, ``behav + alpha * (logp - behav)`` per token, with
    alpha from the token's version (:func:`_version_alpha`). No grad."""
    alpha = _version_alpha(versions, version).to(logp.device, torch.float32)
    behav = behav_logp.detach().to(logp.device, torch.float32)
    return (behav + alpha * (logp.detach().float() - behav)).to(logp.dtype)


def linear_proximal(
    logp: torch.Tensor, behav_logp: torch.Tensor, versions: torch.Tensor, version: int
) -> torch.Tensor:
    """The same interpolation in probability space (AReaL's linear approximation, logged
    under prox_logp_method: metrics): ``log((1 - alpha) p_behav + alpha p)``. No grad."""
    alpha = _version_alpha(versions, version).to(logp.device, torch.float32)
    behav = behav_logp.detach().to(logp.device, torch.float32)
    mixed = (1 - alpha) * torch.exp(behav) + alpha * torch.exp(logp.detach().float())
    return torch.log(mixed.clamp(min=1e-30)).to(logp.dtype)


# ----------------------------------------------------------------------------- distillation


def reverse_kl_loss(
    logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    loss_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (AReaL docs/en/algorithms/distillation.md; KDRL, Xu et al.
    2025, arXiv 2506.02208): the student's reverse KL to the teacher, KL(pi || pi_T), on
    tokens the student sampled. Per token, ``d = log pi - log pi_T`` (no grad) is the KL's
    sampled estimate, and the loss is ``w * d`` with ``w = exp(logp - behav_logp)``, whose
    gradient ``d * w * grad log pi`` is REINFORCE with reward ``-d`` under importance
    sampling for the behaviour policy: the unbiased gradient of the KL, since
    ``grad KL = E[(log pi - log pi_T) grad log pi]``. (A plain ``logp - teacher_logp``
    penalty, AReaL's joint-loss form, has gradient ``E[grad log pi]``, which is zero on
    policy.) Returns the per-token loss (0 off the mask) and ``d`` (detached, 0 off it)."""
    m = loss_mask.bool()
    zero = torch.zeros_like(logp)
    d = torch.where(m, logp.detach() - teacher_logp.detach().to(logp.dtype), zero)
    w = torch.exp(torch.where(m, logp - behav_logp.detach().to(logp.dtype), zero))
    return torch.where(m, w * d, zero), d


# ----------------------------------------------------------------------------- DPO


def dpo_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    chosen_len: torch.Tensor | None = None,
    rejected_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """DPO per pair (Rafailov et al. 2023, arXiv 2305.18290, eq. 7), from each answer's
    summed logprob under the policy and the frozen reference:
    ``r = beta * (logp - ref_logp)`` is the implicit reward, and the loss is
    ``-log sigmoid(r_chosen - r_rejected)``. ``loss_type: ipo`` (Azar et al. 2023,
    arXiv 2310.12036; AReaL's and TRL's convention) takes the log-ratios per answer
    token, ``h = (logp_c - ref_c) / len_c - (logp_r - ref_r) / len_r``, and the loss
    ``(h - 1 / (2 beta))^2``. Stats per pair (detached): ``chosen_reward``,
    ``rejected_reward``, ``margin`` (their difference), ``correct`` (margin > 0)."""
    chosen_ratio = chosen_logp - ref_chosen_logp.detach()
    rejected_ratio = rejected_logp - ref_rejected_logp.detach()
    if loss_type == "sigmoid":
        loss = -torch.nn.functional.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    elif loss_type == "ipo":
        if chosen_len is None or rejected_len is None:
            raise ValueError("ipo needs the answers' token counts")
        h = chosen_ratio / chosen_len.clamp(min=1) - rejected_ratio / rejected_len.clamp(min=1)
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose sigmoid or ipo")
    chosen_reward = beta * chosen_ratio.detach()
    rejected_reward = beta * rejected_ratio.detach()
    margin = chosen_reward - rejected_reward
    stats: Stats = {
        "chosen_reward": chosen_reward,
        "rejected_reward": rejected_reward,
        "margin": margin,
        "correct": (margin > 0).to(margin.dtype),
    }
    return loss, stats


# ----------------------------------------------------------------------------- KL


def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, with ``d = logp - ref_logp``.

    ``k1 = d``; ``k2 = d^2 / 2``; ``k3 = exp(-d) + d - 1`` (= ``exp(ref - logp) - (ref - logp) - 1``,
    unbiased and always >= 0).
    """
    d = logp - ref_logp.detach()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"unknown kl estimator {estimator!r}; choose from {KL_ESTIMATORS}")


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    kl_ctl: float,
    estimator: KLEstimator = "k3",
) -> torch.Tensor:
    """Per-token penalty ``kl_ctl * k(logp, ref_logp)``, zero outside the mask; add it to the token loss."""
    m = loss_mask.bool()
    # Zero d at masked-out positions so exp(-d) in k3 cannot overflow on garbage values.
    safe_logp = torch.where(m, logp, ref_logp.detach())
    kl = kl_estimate(safe_logp, ref_logp, estimator)
    return torch.where(m, kl_ctl * kl, torch.zeros_like(kl))


# ----------------------------------------------------------------------------- aggregation


def loss_normalizer(
    loss_masks: torch.Tensor | Sequence[torch.Tensor],
    mode: LossAggMode = "token_mean",
    seq_ids: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
) -> int:
    """Global normalizer for :func:`aggregate_loss` over all micro-batches of a global batch.

    ``token_mean``: total number of loss tokens. ``seq_mean``: number of sequences with at least
    one loss token (sequences with none contribute nothing and are not counted). Pass every
    micro-batch of this rank; under data parallelism all-reduce (sum) the result across ranks.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose from {LOSS_AGG_MODES}")
    masks = [loss_masks] if isinstance(loss_masks, torch.Tensor) else list(loss_masks)
    if seq_ids is None or isinstance(seq_ids, torch.Tensor):
        ids_list: list[torch.Tensor | None] = [seq_ids] * len(masks)
    else:
        ids_list = list(seq_ids)
    if len(ids_list) != len(masks):
        raise ValueError("need one seq_ids entry per loss mask")
    total = 0
    for mask, ids in zip(masks, ids_list, strict=True):
        m = mask.bool()
        if mode == "token_mean":
            total += int(m.sum())
        else:
            total += int(torch.unique(_resolve_seq_ids(mask, ids)[m]).numel())
    return total


def aggregate_loss(
    loss_tok: torch.Tensor,
    loss_mask: torch.Tensor,
    normalizer: float,
    mode: LossAggMode = "token_mean",
    seq_ids: torch.Tensor | None = None,
    seq_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses of one micro-batch to a scalar share of the global-batch loss.

    ``token_mean``: ``sum_t m_t l_t / N_tok``. ``seq_mean``: ``sum_s mean_{t in s, m_t} l_t / N_seq``.
    With ``normalizer`` the *global* N (from :func:`loss_normalizer`), summing this over any split of
    the batch into micro-batches (sequences kept whole) equals the whole-batch value, gradients too.
    ``seq_counts`` (masked tokens of each sequence, counted over the whole sequence) lets a
    micro-batch hold only part of a sequence (context parallelism): the per-sequence means
    are then taken over the sequence's full count, so the parts' shares add up.
    """
    if normalizer <= 0:
        # An all-masked batch: return a graph-connected zero so backward() still works.
        return loss_tok.sum() * 0.0
    m = loss_mask.bool()
    masked = torch.where(m, loss_tok, torch.zeros_like(loss_tok))
    if mode == "token_mean":
        return masked.sum() / normalizer
    if mode != "seq_mean":
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose from {LOSS_AGG_MODES}")
    ids = _resolve_seq_ids(loss_mask, seq_ids).reshape(-1)
    n_seq = len(seq_counts) if seq_counts is not None else _slots(ids)
    sums = masked.new_zeros(n_seq).index_add(0, ids, masked.reshape(-1))
    if seq_counts is not None:
        counts = seq_counts.to(masked)
    else:
        counts = masked.new_zeros(n_seq).index_add(0, ids, m.reshape(-1).to(masked.dtype))
    return (sums / counts.clamp(min=1)).sum() / normalizer


# ----------------------------------------------------------------------------- logits


class VocabShard(NamedTuple):
    """Logits split over the vocabulary (a tensor-parallel LM head): this rank holds
    columns `start .. start + width` of them, and `group` holds the other columns."""

    group: Any  # torch.distributed.ProcessGroup
    start: int


def _logsumexp(z: torch.Tensor, vocab: VocabShard | None) -> torch.Tensor:
    """logsumexp over the last dim, across the vocabulary shards when split."""
    if vocab is None:
        return torch.logsumexp(z, dim=-1)
    top = z.detach().amax(dim=-1)  # a shift for stability: any value works, so no gradient
    collectives.max_in_place(top, vocab.group)
    total = collectives.sum_over_shards(torch.exp(z - top.unsqueeze(-1)).sum(dim=-1), vocab.group)
    return torch.log(total) + top


def _on_shard(
    target: torch.Tensor, vocab: VocabShard, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target` as columns of this rank's `width` columns of the vocabulary (clamped into
    range), and where this rank holds it."""
    local = target - vocab.start
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), inside


def _pick(z: torch.Tensor, target: torch.Tensor, vocab: VocabShard | None) -> torch.Tensor:
    """z[..., target] (target has a trailing dim of 1), from whichever shard holds it."""
    if vocab is None:
        return z.gather(-1, target).squeeze(-1)
    local, inside = _on_shard(target, vocab, z.shape[-1])
    picked = z.gather(-1, local).squeeze(-1)
    picked = torch.where(inside.squeeze(-1), picked, torch.zeros_like(picked))
    return collectives.sum_over_shards(picked, vocab.group)


def _entropy(z: torch.Tensor, lse: torch.Tensor, vocab: VocabShard | None) -> torch.Tensor:
    """``logsumexp(z) - sum_v softmax(z)_v z_v`` per position, given `lse` = logsumexp(z)
    (over the shards when the vocabulary is split)."""
    expected = (torch.exp(z - lse.unsqueeze(-1)) * z).sum(dim=-1)
    if vocab is not None:
        expected = collectives.sum_over_shards(expected, vocab.group)
    return lse - expected


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
    vocab: VocabShard | None = None,
) -> torch.Tensor:
    """Token-aligned logprobs ``out[t] = log_softmax(logits[t-1] / T)[input_ids[t]]``.

    Logits at position t predict token t+1, so each token is scored by the previous position.
    The first token of each sequence has no prediction and gets 0 (it is a prompt token, never
    trained). Layouts: padded ``logits [..., S, V]`` with ``input_ids [..., S]``; or packed
    ``logits [T, V]``, ``input_ids [T]`` with ``cu_seqlens [n+1]`` marking sequence starts, whose
    positions would otherwise be scored by the previous sequence's last logits.

    With `vocab`, `logits` hold only this rank's slice of the vocabulary. The log-softmax
    then takes a max and a sum of exponentials over the shards (two all-reduces of one
    value per token) and the target's logit from the shard that holds it (a third), so the
    full logits are never gathered: per token, 3 numbers cross instead of V.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = _upcast(logits[..., :-1, :]) / temperature
    target = input_ids[..., 1:].long().unsqueeze(-1)
    # logsumexp + gather avoids materialising a second [T, V] log_softmax tensor.
    lp = _pick(scaled, target, vocab) - _logsumexp(scaled, vocab)
    # Built from the shape, not lp[..., :1], which is empty for a one-token sequence.
    first = lp.new_zeros((*lp.shape[:-1], 1))
    out = torch.cat([first, lp], dim=-1)
    if cu_seqlens is not None:
        if input_ids.dim() != 1:
            raise ValueError("cu_seqlens requires packed 1-D input_ids")
        starts = cu_seqlens[:-1].long().to(out.device)
        starts = starts[starts < out.shape[-1]]
        out = out.index_fill(-1, starts, 0.0)
    return out


IGNORE = -100  # a label position with no next token (the last token of a sequence, padding)


# Positions per chunk of `label_logprobs_and_entropy`: about this many float32 elements of
# [positions, vocabulary] at once (64 MiB), whatever the vocabulary.
CHUNK_ELEMENTS = 1 << 24


def _chunks(rows: int, width: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


class _LabelLogprobs(torch.autograd.Function):
    """Label logprobs and the entropy in one pass over the logits, chunk by chunk of
    positions, without a float32 copy of the whole [T, V]: the forward keeps the logits
    (as they came: bf16 on a GPU) and each position's logsumexp; the backward writes
    d lp / d logits = (onehot(label) - softmax(z)) / T chunk by chunk into one gradient
    in the logits' dtype. With a vocabulary split over ranks, the forward reduces over the
    shards (one chunk after another, in the same order on every rank) and the backward
    needs no collective: softmax uses the saved logsumexp, and only the shard holding a
    label adds its onehot."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab, with_entropy):
        valid = labels != IGNORE
        target = torch.where(valid, labels, torch.zeros_like(labels)).long().unsqueeze(-1)
        rows = logits.shape[0]
        lp = logits.new_zeros(rows, dtype=torch.float32)
        lse = logits.new_zeros(rows, dtype=torch.float32)
        ent = logits.new_zeros(rows, dtype=torch.float32) if with_entropy else None
        for part in _chunks(rows, logits.shape[-1]):
            z = _upcast(logits[part]) / temperature
            lse[part] = _logsumexp(z, vocab)
            lp[part] = _pick(z, target[part], vocab) - lse[part]
            if ent is not None:
                ent[part] = _entropy(z, lse[part], vocab)
        lp = torch.where(valid, lp, torch.zeros_like(lp))
        ctx.save_for_backward(logits, target, valid, lse)
        ctx.temperature, ctx.vocab = temperature, vocab
        if ent is None:
            return lp, lp.new_zeros(0)
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        logits, target, valid, lse = ctx.saved_tensors
        temperature, vocab = ctx.temperature, ctx.vocab
        grad_lp = torch.where(valid, grad_lp, torch.zeros_like(grad_lp))
        local, inside = target, None
        if vocab is not None:
            local, inside = _on_shard(target, vocab, logits.shape[-1])
        grad = torch.empty_like(logits)
        for part in _chunks(logits.shape[0], logits.shape[-1]):
            z = _upcast(logits[part]) / temperature
            g = torch.exp(z - lse[part].unsqueeze(-1)).mul_(-grad_lp[part].unsqueeze(-1))
            hit = grad_lp[part].unsqueeze(-1)
            if inside is not None:
                hit = torch.where(inside[part], hit, torch.zeros_like(hit))
            g.scatter_add_(-1, local[part], hit)
            grad[part] = (g / temperature).to(grad.dtype)
        return grad, None, None, None, None


def label_logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    vocab: VocabShard | None = None,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``lp[p] = log_softmax(logits[p] / T)[labels[p]]`` (differentiable; 0 where
    ``labels[p] == IGNORE``) and `entropy_from_logits` (not; None without `entropy`) of
    packed [T, V] logits, in one chunked pass that never holds a float32 copy of the whole
    logits, forward or backward (`_LabelLogprobs`).

    The label-space twin of `token_logprobs`: position p is scored against the token that
    follows it (the caller shifts the targets, not the logits), so a slice of positions
    needs no neighbouring slice; context parallelism cuts micro-batches this way."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lp, ent = _LabelLogprobs.apply(logits, labels, temperature, vocab, entropy)
    return lp, (ent if entropy else None)


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, vocab: VocabShard | None = None
) -> torch.Tensor:
    """Per-position entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` with ``z = logits / T``; for logging.
    With `vocab`, reduced over the vocabulary shards like `token_logprobs`."""
    z = _upcast(logits) / temperature
    return _entropy(z, _logsumexp(z, vocab), vocab)


def support_logprob_mean(
    logits: torch.Tensor, support: torch.Tensor, vocab: VocabShard | None = None
) -> torch.Tensor:
    """Per position, the mean over the token ids in `support` (distinct) of
    log_softmax(logits): the spread term of label smoothing, read from whichever shard
    holds each id."""
    z = _upcast(logits)
    local = support if vocab is None else support - vocab.start
    local = local[(local >= 0) & (local < z.shape[-1])]
    # support ids are distinct: covering every column (the whole vocabulary) is a plain sum,
    # with no [tokens, support] copy of the logits
    total = z.sum(-1) if len(local) == z.shape[-1] else z[..., local].sum(-1)
    if vocab is not None:
        total = collectives.sum_over_shards(total, vocab.group)
    return total / len(support) - _logsumexp(z, vocab)
