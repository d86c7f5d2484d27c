"""The embedded engine's two-level inverse-CDF draw against one running sum over the vocabulary."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from areal_cli.inference.sampling import BLOCK, _draw, counter_uniforms, signed64, uniforms

WORD = 2**64 - 1


def _seqs(rows: int, seed: int) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(
            seed=seed * 1000 + i, output_ids=[], params=SimpleNamespace(top_k=0, top_p=1.0)
        )
        for i in range(rows)
    ]


def _reference(logprobs: torch.Tensor, seqs: list[SimpleNamespace]) -> torch.Tensor:
    cdf = torch.cumsum(logprobs.exp().double(), dim=-1)
    u = uniforms(seqs, logprobs.device)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]


def _splitmix(seed: int, index: int) -> float:
    """counter_uniforms written out on Python's unbounded ints, masked to 64 bits."""

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & WORD
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & WORD
        return z ^ (z >> 31)

    z = mix((mix(seed & WORD) + (index + 1) * 0x9E3779B97F4A7C15) & WORD)
    return (z >> 11) * 2.0**-53


def test_counter_uniforms_are_splitmix64_of_seed_and_index() -> None:
    seeds = [0, 1, 7, 2**63 - 1, -1, -(2**63), 123456789123, 2**64 + 5]
    pairs = [(s, i) for s in seeds for i in (0, 1, 2, 1000, 2**31)]
    got = counter_uniforms(
        torch.tensor([signed64(s) for s, _ in pairs]), torch.tensor([i for _, i in pairs])
    )
    assert got.dtype == torch.float64
    assert got.tolist() == [_splitmix(s, i) for s, i in pairs]


def test_counter_uniforms_look_uniform_and_independent() -> None:
    rows = torch.arange(20000)
    u = counter_uniforms(rows % 100, rows // 100)  # 100 neighbouring seeds x 200 tokens
    assert bool(((u >= 0) & (u < 1)).all())
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float(((counts - 2000) ** 2 / 2000).sum()) < 40  # chi-square, 9 dof: p ~ 1e-5
    pairs = u.view(200, 100)  # a seed's draws against its neighbour's, token by token
    neighbours = torch.stack([pairs[:, :-1].flatten(), pairs[:, 1:].flatten()])
    assert abs(float(torch.corrcoef(neighbours)[0, 1])) < 0.03


def test_two_level_draw_matches_one_running_sum() -> None:
    torch.manual_seed(0)
    differ = drawn = 0
    for seed, vocab in enumerate([BLOCK * 3, 1000, 49152, 7]):
        logits = torch.randn(64, vocab) * (1 + seed)
        if seed % 2:  # zero-probability entries, and a last block that is partly padding
            logits[:, : vocab // 2] = -float("inf")
        logprobs = torch.log_softmax(logits, dim=-1)
        picks = _draw(logprobs.clone(), _seqs(64, seed))
        assert bool((logprobs.gather(1, picks[:, None]) > -float("inf")).all())
        differ += int((picks != _reference(logprobs, _seqs(64, seed))).sum())
        drawn += 64
    assert differ <= 1, f"{differ} of {drawn} draws differ from one running sum"


def test_draw_follows_the_distribution_and_truncation() -> None:
    logprobs = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3]])).expand(4000, -1).contiguous()
    counts = torch.bincount(_draw(logprobs.clone(), _seqs(4000, 9)), minlength=4) / 4000
    assert counts[1] == 0 and torch.allclose(counts, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.03)
    seqs = _seqs(200, 3)
    for s in seqs:
        s.params.top_k = 1
    assert set(_draw(logprobs[:200].clone(), seqs).tolist()) == {2}


def test_truncation_per_row_matches_the_definition() -> None:
    """truncation_mask, batched with per-row settings, against top-k then top-p written
    out row by row: top-k keeps what is at least as likely as the k-th token; top-p then
    keeps the most likely tokens until their mass reaches p (the crossing token too)."""
    from areal_cli.inference.sampling import truncation_mask

    gen = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(6, 50, generator=gen) * 2, dim=-1)
    top_k = [0, 1, 5, 50, 7, -1]
    top_p = [0.5, 1.0, 1.0, 0.9, 0.3, 1.0]
    got = truncation_mask(probs, top_k, top_p)
    for row in range(6):
        p, k, cap = probs[row], top_k[row], top_p[row]
        ranked = sorted(range(50), key=lambda v: -float(p[v]))
        if 0 < k < 50:
            ranked = [v for v in ranked if p[v] >= p[ranked[k - 1]]]
        kept, mass = set(), 0.0
        for v in ranked:
            if mass >= cap:
                break
            kept.add(v)
            mass += float(p[v])
        assert set(torch.nonzero(got[row])[:, 0].tolist()) == kept, row
