"""GAE, the clipped value loss and explained variance against plain per-sequence loops
written here, on random inputs with sequences that end by EOS and by the length limit."""

from __future__ import annotations

import pytest
import torch

from areal_cli.trainer.values import explained_variance, gae, value_loss


def _reference(values, rewards, last_value, ended, gamma, lam):
    """One sequence, as the textbook writes it."""
    n = len(values)
    adv = [0.0] * n
    after = 0.0
    for t in reversed(range(n)):
        if t == n - 1:
            nxt = 0.0 if ended else last_value
        else:
            nxt = values[t + 1]
        delta = rewards[t] + gamma * nxt - values[t]
        after = delta + gamma * lam * after
        adv[t] = after
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.5)])
def test_gae_matches_the_reference(gamma: float, lam: float) -> None:
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 5, 9, 3, 9, 7]
    ended = torch.tensor([True, False, True, False, False, True])
    width = max(lengths)
    values = torch.randn(len(lengths), width, generator=gen, dtype=torch.float64)
    rewards = torch.randn(len(lengths), width, generator=gen, dtype=torch.float64)
    last_value = torch.randn(len(lengths), generator=gen, dtype=torch.float64)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    values, rewards = values * mask, rewards * mask  # padding holds zeros, as packed data does
    adv, ret = gae(values, rewards, mask, last_value, ended, gamma, lam)
    for b, n in enumerate(lengths):
        want_adv, want_ret = _reference(
            values[b, :n].tolist(), rewards[b, :n].tolist(), float(last_value[b]),
            bool(ended[b]), gamma, lam,
        )  # fmt: skip
        assert adv[b, :n].tolist() == pytest.approx(want_adv, abs=1e-6)
        assert ret[b, :n].tolist() == pytest.approx(want_ret, abs=1e-6)
        assert not adv[b, n:].any() and not ret[b, n:].any()


def test_the_bootstrap_only_counts_for_sequences_cut_by_length() -> None:
    values = torch.tensor([[0.5, 0.5]])
    rewards = torch.tensor([[0.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    eos, _ = gae(values, rewards, mask, torch.tensor([3.0]), torch.tensor([True]), 1.0, 1.0)
    cut, _ = gae(values, rewards, mask, torch.tensor([3.0]), torch.tensor([False]), 1.0, 1.0)
    assert eos[0, -1] == pytest.approx(0.5)  # 1 + 0 - 0.5
    assert cut[0, -1] == pytest.approx(3.5)  # 1 + 3 - 0.5


def test_value_loss_matches_the_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    new, old, ret = (torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(4, 6, generator=gen) > 0.3
    loss, stats = value_loss(new, old, ret, mask, eps_value=0.2)
    clipped_count = 0
    for b in range(4):
        for t in range(6):
            if not mask[b, t]:
                assert loss[b, t] == 0
                continue
            v, o, r = float(new[b, t]), float(old[b, t]), float(ret[b, t])
            held = o + min(max(v - o, -0.2), 0.2)
            want = 0.5 * max((v - r) ** 2, (held - r) ** 2)
            clipped_count += (held - r) ** 2 > (v - r) ** 2
            assert float(loss[b, t]) == pytest.approx(want, abs=1e-6)
    assert stats["value_clip_frac"] == pytest.approx(clipped_count / int(mask.sum()))
    plain, _ = value_loss(new, old, ret, mask, eps_value=None)
    assert torch.allclose(plain, 0.5 * (new - ret) ** 2 * mask)


def test_explained_variance() -> None:
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones_like(ret, dtype=torch.bool)
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 2.5), ret, mask) == pytest.approx(0.0)
    assert explained_variance(-ret, ret, mask) < 0


def test_packed_targets_read_values_where_the_tokens_are() -> None:
    """critic.sequence_targets on a packed micro-batch in label space: each generated
    token's V(s_t) is the critic's output one position before it, the bootstrap is the
    output at the sequence's last position, and multi-turn gaps are skipped."""
    from areal_cli.trainer.critic import sequence_targets
    from areal_cli.trainer.step import label_space

    gen = torch.Generator().manual_seed(3)
    masks = [[0, 0, 1, 1, 1], [0, 1, 1, 0, 1, 1], [0, 0, 0, 1]]  # the middle one: two turns
    seqs = [
        {
            "input_ids": torch.arange(len(m)),
            "loss_mask": torch.tensor(m),
            "logprobs": torch.zeros(len(m)),
            "versions": torch.zeros(len(m), dtype=torch.long),
        }
        for m in masks
    ]
    t = label_space(seqs)
    values = torch.randn(len(t["input_ids"]), generator=gen, dtype=torch.float64)
    rewards = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    ended = torch.tensor([True, False, False])
    adv, ret = sequence_targets(values, t, rewards, ended, 0.9, 0.8)
    start = 0
    for k, m in enumerate(masks):
        generated = [i for i, on in enumerate(m) if on]  # token indices in the sequence
        v = [float(values[start + i - 1]) for i in generated]  # V(s_t): one position before
        r = [0.0] * len(v)
        r[-1] = float(rewards[k])
        want_adv, want_ret = _reference(
            v, r, float(values[start + len(m) - 1]), bool(ended[k]), 0.9, 0.8
        )
        got = [start + i - 1 for i in generated]
        assert adv[got].tolist() == pytest.approx(want_adv, abs=1e-12)
        assert ret[got].tolist() == pytest.approx(want_ret, abs=1e-12)
        start += len(m)
    off = ~t["loss_mask"].bool()
    assert not adv[off].any() and not ret[off].any()
