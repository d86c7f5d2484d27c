"""Reward shaping, reward_norm/adv_norm and the estimator presets, the dual clip and the
learning-rate floor, each against a plain formula written out here with Python lists."""

from __future__ import annotations

import math

import pytest
import torch

from areal_cli.trainer import losses
from areal_cli.trainer.advantages import (
    PRESETS,
    Norm,
    Overlong,
    advantages,
    normalize,
    shape_rewards,
)
from areal_cli.trainer.state import lr_factor

REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0, 2.0, -1.0, 0.0, 0.0]  # 3 groups of 4
G = 4


def _groups(xs: list[float], size: int) -> list[list[float]]:
    return [xs[i : i + size] for i in range(0, len(xs), size)]


def _mean(xs: list[float], ws: list[float] | None = None) -> float:
    ws = ws or [1.0] * len(xs)
    return sum(w * x for w, x in zip(ws, xs, strict=True)) / sum(ws)


def _std(xs: list[float], means: list[float], ws: list[float], unbiased: bool) -> float:
    total = sum(w * (x - m) ** 2 for w, x, m in zip(ws, xs, means, strict=True))
    return math.sqrt(total / (sum(ws) - (1 if unbiased else 0)))


def _close(got: torch.Tensor, want: list[float]) -> None:
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_shaping_scales_biases_and_clips() -> None:
    r = torch.tensor([-3.0, 0.0, 1.0, 10.0])
    _close(shape_rewards(r, scaling=2.0, bias=1.0), [(x + 1) * 2 for x in r.tolist()])
    want = [max(-5.0, min(5.0, (x + 1) * 2)) for x in r.tolist()]
    _close(shape_rewards(r, scaling=2.0, bias=1.0, clip=5.0), want)


def test_group_mean_and_group_std() -> None:
    want = []
    for g in _groups(REWARDS, G):
        m = _mean(g)
        s = _std(g, [m] * G, [1.0] * G, unbiased=False)
        want += [(x - m) / (s + 1e-6) for x in g]
    _close(normalize(torch.tensor(REWARDS), G, Norm("group", "group")), want)


def test_unbiased_std_and_eps() -> None:
    want = []
    for g in _groups(REWARDS, G):
        m = _mean(g)
        s = _std(g, [m] * G, [1.0] * G, unbiased=True)
        want += [(x - m) / (s + 0.1) for x in g]
    norm = Norm("group", "group", unbiased=True, eps=0.1)
    _close(normalize(torch.tensor(REWARDS), G, norm), want)


def test_batch_mean_and_batch_std() -> None:
    m = _mean(REWARDS)
    s = _std(REWARDS, [m] * len(REWARDS), [1.0] * len(REWARDS), unbiased=False)
    want = [(x - m) / (s + 1e-6) for x in REWARDS]
    _close(normalize(torch.tensor(REWARDS), G, Norm("batch", "batch")), want)


def test_group_mean_then_batch_std_about_the_group_means() -> None:
    means = [_mean(g) for g in _groups(REWARDS, G) for _ in range(G)]
    s = _std(REWARDS, means, [1.0] * len(REWARDS), unbiased=False)
    want = [(x - m) / (s + 1e-6) for x, m in zip(REWARDS, means, strict=True)]
    _close(normalize(torch.tensor(REWARDS), G, Norm("group", "batch")), want)


def test_std_without_a_mean_is_about_zero() -> None:
    want = []
    for g in _groups(REWARDS, G):
        s = _std(g, [0.0] * G, [1.0] * G, unbiased=False)
        want += [x / (s + 1e-6) for x in g]
    _close(normalize(torch.tensor(REWARDS), G, Norm("none", "group")), want)


def test_leave_one_out_mean() -> None:
    want = []
    for g in _groups(REWARDS, G):
        want += [x - (sum(g) - x) / (G - 1) for x in g]
    _close(normalize(torch.tensor(REWARDS), G, Norm("group", leave_one_out=True)), want)
    # a group of one leaves nothing: its mean is 0
    _close(normalize(torch.tensor([3.0, -2.0]), 1, Norm("group", leave_one_out=True)), [3.0, -2.0])


def test_token_weighted_batch_whitening() -> None:
    """adv_norm weighs each sequence by its trained tokens: the batch mean and std over
    tokens, every token of a sequence carrying its value."""
    values = [0.5, -1.0, 2.0, 0.0]
    tokens = [3.0, 1.0, 2.0, 4.0]
    per_token = [v for v, n in zip(values, tokens, strict=True) for _ in range(int(n))]
    m = sum(per_token) / len(per_token)
    s = math.sqrt(sum((x - m) ** 2 for x in per_token) / len(per_token))
    got = normalize(torch.tensor(values), 2, Norm("batch", "batch"), torch.tensor(tokens))
    _close(got, [(v - m) / (s + 1e-6) for v in values])


def test_identical_rewards_give_zero_not_nan() -> None:
    got = normalize(torch.ones(8), 4, Norm("group", "group"))
    assert torch.equal(got, torch.zeros(8, dtype=got.dtype))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_named_estimators_are_their_presets(name: str) -> None:
    r = torch.tensor(REWARDS)
    groups = _groups(REWARDS, G)
    means = [_mean(g) for g in groups for _ in range(G)]
    centred = [x - m for x, m in zip(REWARDS, means, strict=True)]
    if name == "grpo":
        stds = [_std(g, [_mean(g)] * G, [1.0] * G, False) for g in groups for _ in range(G)]
        want = [c / (s + 1e-6) for c, s in zip(centred, stds, strict=True)]
    elif name == "dr_grpo":
        want = centred
    elif name == "rloo":
        want = [c * G / (G - 1) for c in centred]
    else:
        s = math.sqrt(sum(c * c for c in centred) / len(centred))
        want = [c / (s + 1e-6) for c in centred]
    _close(losses.compute_advantages(r, G, name), want)
    _close(advantages(r, G, PRESETS[name]), want)


def test_areal_math_default_group_then_batch_whitening() -> None:
    """AReaL's GSM8K recipes: reward_norm group/group, then adv_norm batch/batch over
    trained tokens."""
    tokens = [float(1 + i % 3) for i in range(len(REWARDS))]
    first = []
    for g in _groups(REWARDS, G):
        m = _mean(g)
        s = _std(g, [m] * G, [1.0] * G, False)
        first += [(x - m) / (s + 1e-5) for x in g]
    m = _mean(first, tokens)
    s = _std(first, [m] * len(first), tokens, False)
    want = [(x - m) / (s + 1e-5) for x in first]
    got = advantages(
        torch.tensor(REWARDS),
        G,
        Norm("group", "group", eps=1e-5),
        Norm("batch", "batch", eps=1e-5),
        torch.tensor(tokens),
    )
    assert got.dtype == torch.float32
    _close(got, want)


def test_overlong_penalty_and_no_eos_zeroing() -> None:
    """DAPO's penalty: 0 up to Lmax - B tokens, then linear down to -factor at Lmax; it
    comes before shaping and reward_norm. mask_no_eos_with_zero zeroes after reward_norm."""
    lengths = [10.0, 12.0, 14.0, 16.0, 8.0, 16.0, 13.0, 15.0]
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    cut = [False, False, False, True, False, True, False, False]
    limit, window, factor = 16, 4, 0.5
    penalised = [
        r + min(0.0, -(n - (limit - window)) / window * factor)
        for r, n in zip(rewards, lengths, strict=True)
    ]
    assert penalised[:4] == [1.0, 1.0, -0.25, 0.5]
    shaped = [2.0 * (r + 0.1) for r in penalised]
    want = []
    for g, cuts in zip(_groups(shaped, 4), _groups(cut, 4), strict=True):
        m = _mean(g)
        want += [0.0 if c else x - m for x, c in zip(g, cuts, strict=True)]
    got = advantages(
        torch.tensor(rewards), 4, Norm("group"), trained_tokens=torch.tensor(lengths),
        scaling=2.0, bias=0.1, overlong=Overlong(limit, window, factor),
        zero_if=torch.tensor(cut),
    )  # fmt: skip
    _close(got, want)
    assert Overlong(limit, window, factor).penalty(torch.tensor([20.0])).item() == -1.0


def test_the_batch_carries_truncation_and_its_generation_limit(tmp_path) -> None:
    from areal_cli.rundir import handoff
    from areal_cli.rundir.batch import RolloutBatch, read_batch, write_batch

    seqs = [
        {
            "input_ids": torch.arange(n, dtype=torch.int64),
            "loss_mask": torch.tensor([0] + [1] * (n - 1), dtype=torch.int8),
            "logprobs": torch.zeros(n),
            "versions": torch.zeros(n, dtype=torch.int32),
        }
        for n in (3, 5)
    ]
    batch = RolloutBatch.from_sequences(seqs, [1.0, 0.0], 2)
    batch.truncated, batch.max_new_tokens = torch.tensor([False, True]), 4
    write_batch(tmp_path, 1, batch)
    back = read_batch(handoff.latest(tmp_path, "step-"))
    assert back.truncated.tolist() == [False, True] and back.max_new_tokens == 4
    plain = RolloutBatch.from_sequences(seqs, [1.0, 0.0], 2)
    write_batch(tmp_path, 2, plain)
    old = read_batch(handoff.latest(tmp_path, "step-"))
    assert old.truncated is None and old.max_new_tokens == 0


def test_dual_clip_caps_the_loss_of_negative_advantages() -> None:
    logp = torch.tensor([0.0, 2.0, 2.0, -2.0, 1.5])
    old = torch.zeros(5)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -2.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    loss, stats = losses.ppo_policy_loss(logp, old, adv, mask, eps_clip=0.2, c_clip=3.0)
    want = []
    for lp, a, m in zip(logp.tolist(), adv.tolist(), mask.tolist(), strict=True):
        ratio = math.exp(lp)
        value = max(-a * ratio, -a * min(max(ratio, 0.8), 1.2))
        if a < 0:
            value = min(value, -a * 3.0)
        want.append(value if m else 0.0)
    _close(loss, want)
    # token 1: ratio e^2 = 7.4 with A = -1 loses 7.4 unclipped, capped at 3
    assert float(stats["dual_clip_frac"]) == pytest.approx(1 / 4)
    plain, plain_stats = losses.ppo_policy_loss(logp, old, adv, mask, eps_clip=0.2)
    assert float(plain[1]) == pytest.approx(math.exp(2.0)) and "dual_clip_frac" not in plain_stats


def test_sequence_level_ratio_is_gspo() -> None:
    """Every token of a sequence takes exp(mean of its masked log-ratios), and the
    gradient reaches each of its tokens through that mean."""
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0])
    old = torch.tensor([0.0, -1.0, -2.0, 0.0, -1.0, -0.5, -0.5, 9.0])
    logp = torch.tensor([5.0, -0.9, -2.3, 7.0, -0.2, -0.4, -0.8, 1.0], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 0.5, 0.5, 0.5])
    loss, _ = losses.ppo_policy_loss(logp, old, adv, mask, eps_clip=0.2, seq_ids=seq)
    log_ratios = {0: [0.1, -0.3], 1: [0.8], 2: [0.1, -0.3]}
    want = []
    for i, (s, m) in enumerate(zip(seq.tolist(), mask.tolist(), strict=True)):
        ratio = math.exp(sum(log_ratios[s]) / len(log_ratios[s]))
        a = adv[i].item()
        want.append(max(-a * ratio, -a * min(max(ratio, 0.8), 1.2)) if m else 0.0)
    _close(loss.detach(), want)
    loss.sum().backward()
    # sequence 0 (ratio e^-0.1, inside the clip range, A = 1): each of its |y| = 2 token
    # losses is -ratio, and d ratio / d logp_t = ratio / |y|, so d(sum) / d logp_t = -ratio
    grad = -math.exp(-0.1)
    assert logp.grad[1].item() == pytest.approx(grad) and logp.grad[2].item() == pytest.approx(grad)
    assert logp.grad[0].item() == 0.0  # a prompt token
    # sequence 1: ratio e^0.8 above the range with A = -1: PPO's pessimistic bound keeps
    # the unclipped term, whose gradient is -A * ratio
    assert logp.grad[4].item() == pytest.approx(math.exp(0.8))


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_learning_rate_floor(kind: str) -> None:
    total, warmup, floor = 10, 2, 0.1
    for i in range(12):
        if i < warmup:
            want = (i + 1) / warmup
        else:
            progress = min(1.0, (i - warmup) / (total - warmup))
            if kind == "linear":
                want = 1 - 0.9 * progress
            elif kind == "cosine":
                want = 0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2
            else:
                want = 1.0
        assert lr_factor(i, total, warmup, kind, floor) == pytest.approx(want), i
    assert lr_factor(total, total, warmup, kind, floor) == pytest.approx(
        1.0 if kind == "constant" else floor
    )


def test_the_recipe_keys_are_checked() -> None:
    from tests.conftest import run_areal

    refused = run_areal("validate", "recipes/tiny_cpu.yaml", "actor.adv_norm.std_level=batch")
    assert refused.returncode == 2, refused.stderr
    assert "actor.adv_norm: is only read with actor.adv_estimator: custom" in refused.stderr
    areal_math = [
        *("actor.adv_estimator=custom", "actor.reward_norm.mean_level=group"),
        *("actor.reward_norm.std_level=group", "actor.adv_norm.mean_level=batch"),
        *("actor.adv_norm.std_level=batch", "actor.c_clip=3", "actor.reward_clip=20"),
        "actor.optimizer.min_lr_ratio=0.1",
    ]
    assert run_areal("validate", "recipes/tiny_cpu.yaml", *areal_math).returncode == 0
    bad = run_areal("validate", "recipes/tiny_cpu.yaml", "actor.c_clip=0.5")
    assert bad.returncode == 2 and "actor.c_clip: must be > 1" in bad.stderr, bad.stderr
    window = run_areal(
        "validate", "recipes/tiny_cpu.yaml", "actor.overlong_reward_penalty=true",
        "actor.overlong_tokens=0",
    )  # fmt: skip
    assert window.returncode == 2 and "actor.overlong_tokens: 0 must be between 1" in window.stderr
    gspo_cp = run_areal(
        "validate", "recipes/tiny_cpu.yaml", "actor.importance_sampling_level=sequence",
        "allocation_mode=embedded:d1+fsdp:d1c2", "cluster.n_cpus=3",
    )  # fmt: skip
    assert gspo_cp.returncode == 2 and "sequence (GSPO) needs each sequence" in gspo_cp.stderr
    dynamic_bs_alone = run_areal("validate", "recipes/tiny_cpu.yaml", "rollout.dynamic_bs=true")
    assert dynamic_bs_alone.returncode == 2
    assert "rollout.dynamic_bs: is a mode of dynamic sampling" in dynamic_bs_alone.stderr
    lonely = run_areal(
        "validate", "recipes/tiny_cpu.yaml", "rollout.dynamic_sampling=true",
        "rollout.group_size=1", "actor.adv_estimator=reinforce_pp",
    )  # fmt: skip
    assert lonely.returncode == 2 and "a group of one sample always is" in lonely.stderr
    assert run_areal(
        "validate", "recipes/tiny_cpu.yaml", "rollout.dynamic_sampling=true",
        "rollout.dynamic_bs=true",
    ).returncode == 0  # fmt: skip
