"""actor.rejection_sampling and prox_logp_method against hand computations.

Sources: AReaL's RejectionSamplingConfig and apply_rejection_sampling
(areal/api/cli_args.py, areal/utils/functional/functional.py: the metric is the ratio
pi_prox / pi_behave or a k1/k2/k3 estimate of its KL; at sequence level the ratio is
aggregated in log space and its geometric mean is every token's weight; mask drops,
clamp bounds the weight), and docs/en/algorithms/prox_approx.md (the loglinear and
linear interpolations, alpha = (v_prox - v_behave) / (v_theta - v_behave)).
"""

from __future__ import annotations

import math

import pytest
import torch

from areal_cli.trainer.losses import (
    Rejection,
    behaviour_weights,
    decoupled_ppo_loss,
    linear_proximal,
    loglinear_proximal,
)

LN = math.log
# Two packed sequences; the fifth token is off the loss mask and holds garbage.
#   sequence 0: r = 2, 8        -> geometric mean 4, sum of logs ln 16, max ln 8
#   sequence 1: r = 0.5, 2, (x) -> geometric mean 1
SEQ = torch.tensor([0, 0, 1, 1, 1])
MASK = torch.tensor([1, 1, 1, 1, 0]).bool()
BEHAV = torch.tensor([LN(0.1), LN(0.1), LN(0.4), LN(0.1), -math.inf], dtype=torch.float64)
PROX = torch.tensor([LN(0.2), LN(0.8), LN(0.2), LN(0.2), 0.0], dtype=torch.float64)


def weights(rule: Rejection) -> tuple[list[float], dict]:
    w, _, stats = behaviour_weights(PROX, BEHAV, MASK, rule, SEQ)
    return [round(float(x), 6) for x in w], {k: float(v) for k, v in stats.items()}


def test_token_ratio_mask_is_the_old_cap() -> None:
    w, stats = weights(Rejection(upper=5.0))
    assert w == [2.0, 0.0, 0.5, 2.0, 0.0]  # 8 > 5 is dropped
    assert stats["imp_weight_drop_frac"] == pytest.approx(1 / 4)
    assert stats["imp_weight_max"] == pytest.approx(8.0)  # before filtering


def test_sequence_ratio_mask_uses_the_geometric_mean() -> None:
    w, stats = weights(Rejection(level="sequence", upper=3.0))
    assert w == [0.0, 0.0, 1.0, 1.0, 0.0]  # sequence 0's mean ratio 4 > 3
    assert stats["imp_weight_drop_frac"] == pytest.approx(2 / 4)


@pytest.mark.parametrize(
    ("agg", "upper", "expected"),
    [
        ("max", 5.0, [0.0, 0.0, 1.0, 1.0, 0.0]),  # max ratio 8 > 5; weights stay geometric
        ("sum", 20.0, [4.0, 4.0, 1.0, 1.0, 0.0]),  # exp(ln 16) = 16 <= 20
        ("sum", 10.0, [0.0, 0.0, 1.0, 1.0, 0.0]),  # 16 > 10
    ],
)
def test_sequence_ratio_aggregations(agg: str, upper: float, expected: list[float]) -> None:
    assert weights(Rejection(level="sequence", agg=agg, upper=upper))[0] == expected


def test_token_kl_k2_with_bounds() -> None:
    # k2 = (ln r)^2 / 2: ln2 -> 0.2402, ln8 -> 2.1620, ln0.5 -> 0.2402
    w, _ = weights(Rejection(metric="kl_k2", upper=0.5))
    assert w == [2.0, 0.0, 0.5, 2.0, 0.0]
    # k1 = ln r with a lower bound: ln 0.5 = -0.69 < -0.5 is dropped
    w, _ = weights(Rejection(metric="kl_k1", upper=None, lower=-0.5))
    assert w == [2.0, 8.0, 0.0, 2.0, 0.0]


def test_sequence_kl_k3_mean() -> None:
    # k3 = 1/r - 1 + ln r: r=2 -> 0.1931, r=8 -> 1.2044 (mean 0.6988); r=0.5 -> 0.3069,
    # r=2 -> 0.1931 (mean 0.25). Upper 0.5 drops sequence 0; KL metrics keep token weights.
    w, _ = weights(Rejection(level="sequence", metric="kl_k3", upper=0.5))
    assert w == [0.0, 0.0, 0.5, 2.0, 0.0]


def test_clamp_bounds_the_weight_and_keeps_the_token() -> None:
    w, stats = weights(Rejection(action="clamp", upper=3.0, lower=0.6))
    assert w == [2.0, 3.0, 0.6, 2.0, 0.0]
    assert stats["imp_weight_clamp_frac"] == pytest.approx(2 / 4)
    assert stats["imp_weight_drop_frac"] == 0.0
    # sequence level: sequence 0 (geometric mean 4) is out of bounds, its weights clamp
    w, _ = weights(Rejection(level="sequence", action="clamp", upper=3.0))
    assert w == [3.0, 3.0, 1.0, 1.0, 0.0]


def test_no_bounds_is_no_filter() -> None:
    w, stats = weights(Rejection(upper=None))
    assert w == [2.0, 8.0, 0.5, 2.0, 0.0]
    assert stats["imp_weight_drop_frac"] == 0.0


def test_decoupled_loss_multiplies_by_the_filtered_weight() -> None:
    # on the proximal policy (logp = prox): ratio 1, loss per token = -w * A
    logp = PROX.clone().requires_grad_()
    adv = torch.ones(5, dtype=torch.float64)
    rule = Rejection(level="sequence", upper=3.0)
    loss, stats = decoupled_ppo_loss(
        logp, PROX, BEHAV, adv, MASK, rejection=rule, rejection_seq_ids=SEQ
    )
    assert [round(float(x), 6) for x in loss.detach()] == [0.0, 0.0, -1.0, -1.0, 0.0]
    loss.sum().backward()
    assert [round(float(x), 6) for x in logp.grad] == [0.0, 0.0, -1.0, -1.0, 0.0]
    assert float(stats["behave_approx_kl"]) == pytest.approx(0.0)  # kept: ln 0.5 + ln 2


def test_loglinear_and_linear_proximal() -> None:
    # The step starts at version 3 (v_prox) and makes version 4 (v_theta).
    # token 0 from v3: alpha 0 -> behaviour; token 1 from v1: alpha (3-1)/(4-1) = 2/3;
    # token 2 is a prompt token (version -1): alpha 0.
    versions = torch.tensor([3, 1, -1])
    behav = torch.tensor([LN(0.2), LN(0.3), 0.0], dtype=torch.float64)
    logp = torch.tensor([LN(0.5), LN(0.6), LN(0.9)], dtype=torch.float64)
    log_linear = loglinear_proximal(logp, behav, versions, 3)
    assert log_linear.tolist() == pytest.approx([LN(0.2), LN(0.3) + 2 / 3 * LN(2), 0.0])
    lin = linear_proximal(logp, behav, versions, 3)
    assert lin.tolist() == pytest.approx([LN(0.2), LN(0.3 / 3 + 0.6 * 2 / 3), 0.0])


def test_dpo_loss_by_hand() -> None:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7) and IPO (Azar et al. 2023,
    arXiv 2310.12036, per-token log-ratios as AReaL and TRL take them)."""
    from areal_cli.trainer.losses import dpo_loss

    pi_c, pi_r = torch.tensor([-2.0, -1.0]), torch.tensor([-3.0, -1.0])
    ref_c, ref_r = torch.tensor([-2.5, -1.0]), torch.tensor([-2.0, -0.5])
    # pair 0: ratios +0.5 (chosen), -1.0 (rejected); beta 0.1 -> rewards 0.05, -0.1,
    #         margin 0.15, loss -log sigmoid(0.15) = 0.62096
    # pair 1: ratios 0, -0.5 -> rewards 0, -0.05, margin 0.05, loss 0.66846
    loss, s = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1)
    assert loss.tolist() == pytest.approx([0.620957, 0.668460], abs=1e-6)
    assert s["margin"].tolist() == pytest.approx([0.15, 0.05])
    assert s["chosen_reward"].tolist() == pytest.approx([0.05, 0.0])
    assert s["correct"].tolist() == [1.0, 1.0]
    # ipo, answers of 2 and 4 tokens (chosen) and 1 and 5 (rejected), beta 0.5 (target 1):
    # pair 0: h = 0.5/2 - (-1.0)/1 = 1.25 -> (1.25 - 1)^2 = 0.0625
    # pair 1: h = 0/4 - (-0.5)/5 = 0.1 -> (0.1 - 1)^2 = 0.81
    ipo, _ = dpo_loss(
        pi_c, pi_r, ref_c, ref_r, 0.5, "ipo", torch.tensor([2.0, 4.0]), torch.tensor([1.0, 5.0])
    )
    assert ipo.tolist() == pytest.approx([0.0625, 0.81])


def test_reverse_kl_loss_by_hand() -> None:
    """On-policy distillation's reverse KL (AReaL docs/en/algorithms/distillation.md, KDRL
    arXiv 2506.02208): loss w * d with d = log pi - log pi_T (no grad), w = pi / pi_behav."""
    from areal_cli.trainer.losses import reverse_kl_loss

    logp = torch.tensor([LN(0.5), LN(0.2), LN(0.9)], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([LN(0.25), LN(0.4), 0.0], dtype=torch.float64)
    behav = torch.tensor([LN(0.5), LN(0.1), 0.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 0])
    loss, d = reverse_kl_loss(logp, teacher, behav, mask)
    # token 0: d = ln 2, w = 1 -> ln 2; token 1: d = ln 0.5, w = 2 -> 2 ln 0.5; token 2 masked
    assert d.tolist() == pytest.approx([LN(2), LN(0.5), 0.0])
    assert loss.detach().tolist() == pytest.approx([LN(2), 2 * LN(0.5), 0.0])
    loss.sum().backward()  # d(w * d)/dlogp = w * d: the student is pushed toward the teacher
    assert logp.grad.tolist() == pytest.approx([LN(2), 2 * LN(0.5), 0.0])
