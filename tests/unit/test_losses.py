"""Hand-computed checks of the RL loss functions in areal_cli.trainer.losses."""

import math

import pytest
import torch

from areal_cli.trainer.losses import (
    Rejection,
    aggregate_loss,
    broadcast_to_tokens,
    compute_advantages,
    decoupled_ppo_loss,
    entropy_from_logits,
    kl_estimate,
    kl_penalty,
    loss_normalizer,
    ppo_policy_loss,
    token_logprobs,
)

LN = math.log


def close(actual: torch.Tensor, expected: list[float] | float, atol: float = 1e-6) -> None:
    exp = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), exp, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- advantages

# Two groups of 3: g1 = [1, 2, 3], g2 = [0, 0, 3].
REWARDS = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 3.0])


def test_grpo_population_std() -> None:
    # g1: mean 2, deviations [-1, 0, 1], pop var 2/3, std 0.81650 -> [-1.22474, 0, 1.22474]
    # g2: mean 1, deviations [-1, -1, 2], pop var 6/3 = 2, std 1.41421 -> [-0.70711, -0.70711, 1.41421]
    adv = compute_advantages(REWARDS, group_size=3, estimator="grpo", eps=0.0)
    s1, s2 = math.sqrt(2 / 3), math.sqrt(2)
    close(adv, [-1 / s1, 0, 1 / s1, -1 / s2, -1 / s2, 2 / s2])


def test_grpo_std_is_population_not_unbiased() -> None:
    # [1, 0]: mean 0.5, pop std 0.5 -> +-1 ; the unbiased std 0.7071 would give +-0.7071.
    adv = compute_advantages(torch.tensor([1.0, 0.0]), group_size=2, estimator="grpo", eps=0.0)
    close(adv, [1.0, -1.0])


def test_grpo_constant_group_is_zero_not_nan() -> None:
    # All-equal rewards: deviations 0, std 0 -> 0 / (0 + eps) = 0.
    adv = compute_advantages(torch.tensor([1, 1, 0, 1]), group_size=2, estimator="grpo")
    close(adv, [0.0, 0.0, -1.0, 1.0], atol=1e-5)


def test_dr_grpo() -> None:
    # r - group mean: g1 mean 2 -> [-1, 0, 1]; g2 mean 1 -> [-1, -1, 2]
    adv = compute_advantages(REWARDS, group_size=3, estimator="dr_grpo")
    close(adv, [-1, 0, 1, -1, -1, 2])


def test_rloo() -> None:
    # r_i - mean of the other two:
    # g1: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5
    # g2: 0 - (0+3)/2 = -1.5, 0 - (0+3)/2 = -1.5, 3 - (0+0)/2 = 3
    adv = compute_advantages(REWARDS, group_size=3, estimator="rloo")
    close(adv, [-1.5, 0, 1.5, -1.5, -1.5, 3])


def test_rloo_needs_two_samples() -> None:
    with pytest.raises(ValueError):
        compute_advantages(torch.tensor([1.0, 2.0]), group_size=1, estimator="rloo")


def test_reinforce_pp() -> None:
    # group-centred [-1, 0, 1, -1, -1, 2]; batch mean 0, pop var (1+0+1+1+1+4)/6 = 4/3,
    # std 1.15470 -> [-0.86603, 0, 0.86603, -0.86603, -0.86603, 1.73205]
    adv = compute_advantages(REWARDS, group_size=3, estimator="reinforce_pp", eps=0.0)
    s = math.sqrt(4 / 3)
    close(adv, [-1 / s, 0, 1 / s, -1 / s, -1 / s, 2 / s])


def test_reward_bias_then_scaling() -> None:
    # (r + 1) * 2: g1 -> [4, 6, 8] mean 6 -> [-2, 0, 2]; the bias cancels, the scale doubles.
    adv = compute_advantages(
        REWARDS, group_size=3, estimator="dr_grpo", reward_bias=1.0, reward_scaling=2.0
    )
    close(adv, [-2, 0, 2, -2, -2, 4])


def test_advantage_input_validation() -> None:
    with pytest.raises(ValueError):
        compute_advantages(REWARDS, group_size=4)
    with pytest.raises(ValueError):
        compute_advantages(REWARDS, group_size=3, estimator="ppo")  # type: ignore[arg-type]


def test_broadcast_packed_and_padded() -> None:
    # packed: seq0 = 3 tokens (prompt, gen, gen), seq1 = 2 tokens (prompt, gen)
    seq_adv = torch.tensor([0.5, -2.0])
    mask = torch.tensor([0, 1, 1, 0, 1])
    seq_ids = torch.tensor([0, 0, 0, 1, 1])
    close(broadcast_to_tokens(seq_adv, mask, seq_ids), [0, 0.5, 0.5, 0, -2.0])
    # padded [2, 3]: row b takes seq_adv[b]
    pmask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    close(broadcast_to_tokens(seq_adv, pmask), [[0, 0.5, 0.5], [0, -2.0, 0]])


# ----------------------------------------------------------------------------- PPO


def test_ppo_symmetric_clip() -> None:
    # eps 0.2, ratios [1.3, 0.7, 1.3, 0.7], A = [+1, +1, -1, -1]
    # t0: min(1.3, clip->1.2) * 1 = 1.2 -> loss -1.2 (clipped)
    # t1: min(0.7, 0.8) = 0.7 -> loss -0.7 (not clipped)
    # t2: min(-1.3, -1.2) = -1.3 -> loss 1.3 (not clipped)
    # t3: min(-0.7, -0.8) = -0.8 -> loss 0.8 (clipped)
    ratio = torch.tensor([1.3, 0.7, 1.3, 0.7], dtype=torch.float64)
    logp = ratio.log().requires_grad_()
    old = torch.zeros(4, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    loss, stats = ppo_policy_loss(logp, old, adv, torch.ones(4), eps_clip=0.2)
    close(loss, [-1.2, -0.7, 1.3, 0.8])
    close(stats["clip_frac"], 0.5)  # t0 and t3 of 4
    close(stats["ratio_mean"], 1.0)  # (1.3 + 0.7 + 1.3 + 0.7) / 4
    close(stats["ratio_max"], 1.3)
    # d(-ratio * A)/dlogp = -ratio * A where unclipped, 0 where clipped: [0, -0.7, 1.3, 0]
    loss.sum().backward()
    close(logp.grad, [0.0, -0.7, 1.3, 0.0])


def test_ppo_asymmetric_clip_higher() -> None:
    # eps_low 0.2, eps_high 0.28 (DAPO): range [0.8, 1.28]
    # ratio 1.3, A=+1 -> 1.28 -> loss -1.28 ; ratio 1.25, A=+1 -> inside -> loss -1.25
    # ratio 0.7, A=-1 -> min(-0.7, -0.8) = -0.8 -> loss 0.8 (lower side still 0.2)
    ratio = torch.tensor([1.3, 1.25, 0.7], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    loss, stats = ppo_policy_loss(
        ratio.log(), torch.zeros(3), adv, torch.ones(3), eps_clip=0.2, eps_clip_higher=0.28
    )
    close(loss, [-1.28, -1.25, 0.8])
    close(stats["clip_frac"], 2 / 3)
    # symmetric 0.2 would clip 1.25 to 1.2
    sym, _ = ppo_policy_loss(ratio.log(), torch.zeros(3), adv, torch.ones(3), eps_clip=0.2)
    close(sym, [-1.2, -1.2, 0.8])


def test_ppo_masked_garbage_is_ignored() -> None:
    # Masked-out token holds logp 1e4 vs old -inf: must give loss 0 and finite grads.
    logp = torch.tensor([0.0, 1e4], requires_grad=True)
    old = torch.tensor([0.0, -math.inf])
    loss, stats = ppo_policy_loss(logp, old, torch.ones(2), torch.tensor([1, 0]))
    close(loss, [-1.0, 0.0])
    close(stats["ratio_max"], 1.0)
    loss.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_decoupled_with_capped_behaviour_weights() -> None:
    # cap 3, eps 0.2. Per token: w = exp(prox - behav), ratio = exp(logp - prox)
    # t0: w = 2 (kept), ratio 1.3, A=+1 -> clipped 1.2 -> loss -2 * 1.2 = -2.4
    # t1: w = 4 > 3 -> dropped -> loss 0
    # t2: w = 0.5, ratio 1.0, A=-1 -> loss 0.5 * 1.0 = 0.5
    # t3: masked out, behaviour logprob garbage (-inf) -> loss 0, no NaN
    prox = torch.tensor([LN(0.5), LN(0.4), LN(0.2), 0.0], dtype=torch.float64)
    behav = torch.tensor([LN(0.25), LN(0.1), LN(0.4), -math.inf], dtype=torch.float64)
    logp = torch.tensor([LN(0.65), LN(0.4), LN(0.2), 0.0], dtype=torch.float64)
    logp.requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 0])
    loss, stats = decoupled_ppo_loss(
        logp, prox, behav, adv, mask, eps_clip=0.2, rejection=Rejection(upper=3.0)
    )
    close(loss, [-2.4, 0.0, 0.5, 0.0])
    close(stats["imp_weight_mean"], (2 + 4 + 0.5) / 3)  # over the loss mask, before dropping
    close(stats["imp_weight_max"], 4.0)
    close(stats["imp_weight_drop_frac"], 1 / 3)
    # grads: t0 clipped -> 0; t1 dropped -> 0; t2: d(w * -A * ratio)/dlogp = 0.5 * 1 * 1 = 0.5
    loss.sum().backward()
    close(logp.grad, [0.0, 0.0, 0.5, 0.0])
    # without a cap t1 counts: w 4, ratio 1, A=+1 -> -4
    uncapped, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    close(uncapped, [-2.4, -4.0, 0.5, 0.0])


def test_decoupled_equals_ppo_when_on_policy() -> None:
    # behav == prox -> w = 1 everywhere -> identical to plain PPO against prox.
    g = torch.Generator().manual_seed(0)
    logp, prox, adv = (torch.randn(8, generator=g) * 0.3 for _ in range(3))
    mask = torch.ones(8)
    dec, _ = decoupled_ppo_loss(logp, prox, prox, adv, mask, rejection=Rejection(upper=2.0))
    ppo, _ = ppo_policy_loss(logp, prox, adv, mask)
    close(dec, ppo.tolist())


# ----------------------------------------------------------------------------- KL


def test_kl_estimators() -> None:
    # logp = ln 0.5, ref = ln 0.25 -> d = logp - ref = ln 2 = 0.693147
    # k1 = 0.693147 ; k2 = 0.5 * 0.480453 = 0.240227 ; k3 = exp(-ln2) + ln2 - 1 = 0.5 + 0.693147 - 1
    logp = torch.tensor([LN(0.5)], dtype=torch.float64)
    ref = torch.tensor([LN(0.25)], dtype=torch.float64)
    d = LN(2)
    close(kl_estimate(logp, ref, "k1"), [d])
    close(kl_estimate(logp, ref, "k2"), [0.5 * d * d])
    close(kl_estimate(logp, ref, "k3"), [0.5 + d - 1])
    # equal policies -> all zero
    for est in ("k1", "k2", "k3"):
        close(kl_estimate(ref, ref, est), [0.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_kl_penalty_coefficient_and_mask() -> None:
    # kl_ctl 0.1 * k3(ln 2) = 0.1 * 0.193147 = 0.0193147 ; masked token (garbage 1e4) -> 0
    logp = torch.tensor([LN(0.5), -1e4], dtype=torch.float64)
    ref = torch.tensor([LN(0.25), 0.0], dtype=torch.float64)
    pen = kl_penalty(logp, ref, torch.tensor([1, 0]), kl_ctl=0.1, estimator="k3")
    close(pen, [0.1 * (0.5 + LN(2) - 1), 0.0])


# ----------------------------------------------------------------------------- aggregation


def test_token_vs_seq_mean() -> None:
    # seq0 losses [1, 2, 3] all trained; seq1 losses [4, 100] with only the 4 trained.
    # token_mean = (1 + 2 + 3 + 4) / 4 = 2.5 ; seq_mean = (mean(1,2,3)=2 + 4) / 2 = 3
    loss_tok = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    ids = torch.tensor([0, 0, 0, 1, 1])
    n_tok = loss_normalizer(mask, "token_mean")
    n_seq = loss_normalizer(mask, "seq_mean", ids)
    assert (n_tok, n_seq) == (4, 2)
    close(aggregate_loss(loss_tok, mask, n_tok, "token_mean"), 2.5)
    close(aggregate_loss(loss_tok, mask, n_seq, "seq_mean", ids), 3.0)
    # same data padded [2, 3]: rows are sequences, seq_ids inferred
    p_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 7.0]])
    p_mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert loss_normalizer(p_mask, "seq_mean") == 2
    close(aggregate_loss(p_loss, p_mask, 2, "seq_mean"), 3.0)


def test_seq_without_loss_tokens_not_counted() -> None:
    # seq1 is all prompt: it adds nothing and is not in the normalizer -> seq_mean = 2 / 1
    mask = torch.tensor([1, 1, 0, 0])
    ids = torch.tensor([0, 0, 1, 1])
    assert loss_normalizer(mask, "seq_mean", ids) == 1
    close(aggregate_loss(torch.tensor([1.0, 3.0, 9.0, 9.0]), mask, 1, "seq_mean", ids), 2.0)


def test_empty_mask_gives_zero_with_grad() -> None:
    x = torch.ones(3, requires_grad=True)
    out = aggregate_loss(x * 2, torch.zeros(3), 0, "token_mean")
    out.backward()
    close(out, 0.0)
    close(x.grad, [0.0, 0.0, 0.0])


def _split_batch_loss(
    model: torch.nn.Module,
    seqs: list[torch.Tensor],
    masks: list[torch.Tensor],
    parts: list[list[int]],
    mode: str,
    local_norm: bool = False,
) -> torch.Tensor:
    """Sum over micro-batches of the aggregated decoupled-PPO + KL loss (global normalizer unless local_norm)."""
    packed = [
        (
            torch.cat([seqs[i] for i in p]),
            torch.cat([masks[i] for i in p]),
            torch.repeat_interleave(torch.arange(len(p)), torch.tensor([len(seqs[i]) for i in p])),
            torch.tensor([0] + [len(seqs[i]) for i in p]).cumsum(0),
            torch.tensor(p),
        )
        for p in parts
    ]
    norm = loss_normalizer([pk[1] for pk in packed], mode, [pk[2] for pk in packed])  # type: ignore[arg-type]
    seq_adv = torch.linspace(-1.0, 1.0, len(seqs), dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for ids, mask, seq_ids, cu, members in packed:
        logp = token_logprobs(model(ids), ids, temperature=0.7, cu_seqlens=cu)
        # stale policies are fixed functions of the token ids (no grad)
        prox = (logp.detach() - 0.2 * torch.cos(ids.double())).detach()
        behav = prox - 0.3 * torch.sin(ids.double())
        adv = broadcast_to_tokens(seq_adv[members], mask, seq_ids)
        loss_tok, _ = decoupled_ppo_loss(
            logp, prox, behav, adv, mask, eps_clip=0.1, eps_clip_higher=0.15,
            rejection=Rejection(upper=1.25),
        )  # fmt: skip
        loss_tok = loss_tok + kl_penalty(logp, prox - 0.1, mask, kl_ctl=0.05, estimator="k3")
        if local_norm:  # the bug this API prevents: normalising each micro-batch by itself
            norm = loss_normalizer(mask, mode, seq_ids)  # type: ignore[arg-type]
        total = total + aggregate_loss(loss_tok, mask, norm, mode, seq_ids)  # type: ignore[arg-type]
    return total


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean"])
def test_split_invariance_values_and_grads(mode: str) -> None:
    torch.manual_seed(0)
    vocab = 11
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab)).double()
    lengths = [5, 3, 7, 4, 6, 2]
    seqs = [torch.randint(0, vocab, (n,)) for n in lengths]
    # first two tokens are prompt; one sequence has a masked hole in its completion
    masks = [torch.tensor([0, 0] + [1] * (n - 2)) for n in lengths]
    masks[2][4] = 0
    splits = {
        1: [[0, 1, 2, 3, 4, 5]],
        2: [[4, 1, 0], [5, 2, 3]],
        3: [[2], [0, 5, 3], [1, 4]],
    }
    results = []
    for parts in splits.values():
        model.zero_grad()
        loss = _split_batch_loss(model, seqs, masks, parts, mode)
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])
        results.append((loss.detach(), grads))
    whole_loss, whole_grads = results[0]
    assert whole_grads.abs().sum() > 0
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, whole_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(grads, whole_grads, atol=1e-6, rtol=0)
    # control: per-micro-batch normalisation does change the loss, so the check has teeth
    local = _split_batch_loss(model, seqs, masks, splits[3], mode, local_norm=True)
    assert abs(float(local.detach()) - float(whole_loss)) > 1e-3


# ----------------------------------------------------------------------------- logits


def test_token_logprobs_shift_and_temperature() -> None:
    # vocab 2, tokens [1, 0, 1]. Position 0 logits [0, ln 3] / T=1 -> softmax [1/4, 3/4]
    # -> out[1] = log p(token 0) = ln(1/4). Position 1 logits [0, 0] -> out[2] = ln(1/2).
    # out[0] = 0 (nothing predicts the first token). Last position's logits are unused.
    logits = torch.tensor([[0.0, LN(3)], [0.0, 0.0], [5.0, -5.0]], dtype=torch.float64)
    ids = torch.tensor([1, 0, 1])
    close(token_logprobs(logits, ids), [0.0, LN(0.25), LN(0.5)])
    # T = 0.5 doubles the logits: [0, 2 ln 3] -> softmax [1/10, 9/10] -> out[1] = ln(0.1)
    close(token_logprobs(logits, ids, temperature=0.5), [0.0, LN(0.1), LN(0.5)])
    # a one-token sequence has nothing predicted: a single 0
    close(token_logprobs(logits[:1], ids[:1]), [0.0])


def test_token_logprobs_packed_matches_padded() -> None:
    # packed seqs [3 tokens | 2 tokens]: the second sequence's first token must get 0,
    # not a score from the first sequence's last logits.
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 7, generator=g)
    ids = torch.tensor([3, 1, 6, 2, 5])
    out = token_logprobs(logits, ids, cu_seqlens=torch.tensor([0, 3, 5]))
    a = token_logprobs(logits[:3], ids[:3])
    b = token_logprobs(logits[3:], ids[3:])
    close(out, torch.cat([a, b]).tolist())
    assert out[3] == 0.0
    # padded [B, S, V] layout gives the same per-row values
    padded = token_logprobs(logits[:4].reshape(2, 2, 7), ids[:4].reshape(2, 2))
    close(padded[1], token_logprobs(logits[2:4], ids[2:4]).tolist())


def test_entropy_from_logits() -> None:
    # uniform over 4 -> ln 4 ; one-hot-ish [0, -inf] -> 0 ; [0, ln 3] -> p = [1/4, 3/4]
    # -> H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335
    logits = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [0.0, -1e9, -1e9, -1e9], [0.0, LN(3), -1e9, -1e9]],
        dtype=torch.float64,
    )
    h = entropy_from_logits(logits)
    close(h, [LN(4), 0.0, -(0.25 * LN(0.25) + 0.75 * LN(0.75))])
    # temperature 2 on [0, 2 ln 3] gives the same distribution as T=1 on [0, ln 3]
    close(entropy_from_logits(torch.tensor([0.0, 2 * LN(3)]), temperature=2.0).reshape(1), [h[2]])


# ----------------------------------------------------------------------------- chunked logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [7 * 3, 1 << 24])  # 3 positions a chunk; one chunk
def test_chunked_logprobs_and_entropy_match_the_plain_functions(
    dtype: torch.dtype, chunk_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """label_logprobs_and_entropy: the values of log_softmax(logits / T) at the labels
    and of entropy_from_logits, and autograd's gradient of the logits (in their dtype)
    through that written-out definition, chunk by chunk or in one; the IGNORE positions
    score 0 and take no gradient."""
    from areal_cli.trainer import losses

    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 7, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, 7, (10,), generator=gen)
    labels[[3, 9]] = losses.IGNORE
    weights = torch.randn(10, generator=gen)
    a = logits.clone().requires_grad_(True)
    lp, ent = losses.label_logprobs_and_entropy(a, labels, 0.7)
    (lp * weights).sum().backward()
    b = logits.clone().requires_grad_(True)
    valid = labels != losses.IGNORE
    picked = torch.log_softmax(b.float() / 0.7, dim=-1).gather(1, labels.clamp(min=0)[:, None])
    want = torch.where(valid, picked[:, 0], torch.zeros(()))
    (want * weights).sum().backward()
    torch.testing.assert_close(lp, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, entropy_from_logits(logits, 0.7), atol=1e-6, rtol=1e-6)
    assert a.grad.dtype == dtype and float(lp[3].detach()) == 0.0 and float(lp[9].detach()) == 0.0
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(a.grad, b.grad, atol=tol, rtol=tol)
    assert not a.grad[3].any() and not a.grad[9].any()
    none = losses.label_logprobs_and_entropy(logits, labels, 0.7, entropy=False)[1]
    assert none is None


# ----------------------------------------------------------------------------- SAPO, M2PO


def test_sapo_gates_by_hand() -> None:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347, and
    AReaL's `sapo_loss_fn`): loss = -(4 / tau) * sigmoid(tau * (r - 1)) * A, tau = tau_pos
    for A > 0 else tau_neg. By hand, tau_pos = 1, tau_neg = 2:
      r = 1,   A = +1: -(4/1) * sigmoid(0)       = -2
      r = 1.5, A = +2: -(4/1) * sigmoid(0.5) * 2 = -8 * 0.622459 = -4.979674
      r = 0.5, A = -1: +(4/2) * sigmoid(-1)      = 2 * 0.268941 = 0.537883
      the masked 4th token: 0.
    The gradient wrt logp at r = 1 is -A (the policy gradient): d/dlogp = -(4/tau) *
    tau * sigmoid'(0) * r * A = -A."""
    from areal_cli.trainer.losses import sapo_policy_loss

    logp = torch.tensor([0.0, LN(1.5), LN(0.5), 5.0], requires_grad=True)
    adv = torch.tensor([1.0, 2.0, -1.0, 3.0])
    mask = torch.tensor([1, 1, 1, 0])
    loss, stats = sapo_policy_loss(logp, torch.zeros(4), adv, mask, tau_pos=1.0, tau_neg=2.0)
    close(loss, [-2.0, -4.979674, 0.537883, 0.0], atol=1e-5)
    loss.sum().backward()
    assert float(logp.grad[0]) == pytest.approx(-1.0, abs=1e-6)
    assert float(logp.grad[3]) == 0.0
    close(stats["clip_frac"], 0.0)
    close(stats["ratio_mean"], (1 + 1.5 + 0.5) / 3, atol=1e-6)


def test_m2po_cutoff_by_hand() -> None:
    """M2PO (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL
    Reach with Stale Data on LLMs?", arXiv 2510.01161; AReaL's docs/en/algorithms/m2po.md):
    drop the tokens with the largest second moment m2 = (log r)^2 until the mean of the
    rest is below the threshold. m2 = [0.5, 0.0625, 0.25, 0.125] (exact in binary),
    threshold 0.2: all (0.234375) -> drop 0.5: (0.25 + 0.125 + 0.0625) / 3 = 0.1458 < 0.2,
    so only 0.5 goes (bound 0.25: keep m2 <= 0.25). Threshold 0.09375: drop 0.5 (0.1458),
    0.25 ((0.125 + 0.0625) / 2 = 0.09375, not below), 0.125 -> 0.0625: only the smallest
    stays. A mean already below keeps all; all alike and above keeps them all (at least
    one token, and ties with the largest kept one stay)."""
    from areal_cli.trainer.losses import m2_cutoff

    m2 = torch.tensor([0.5, 0.0625, 0.25, 0.125])
    assert (m2 <= m2_cutoff(m2, 0.2)).tolist() == [False, True, True, True]
    assert (m2 <= m2_cutoff(m2, 0.09375)).tolist() == [False, True, False, False]
    assert m2_cutoff(m2, 1.0) == math.inf
    alike = torch.full((3,), 0.5)
    assert (alike <= m2_cutoff(alike, 0.1)).all()
    assert m2_cutoff(torch.zeros(0), 0.1) == math.inf
    # the order the tokens come in (ranks, micro-batches) does not matter
    assert m2_cutoff(m2.flip(0), 0.2) == m2_cutoff(m2, 0.2)
