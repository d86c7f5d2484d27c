"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code")."""

from __future__ import annotations

from collections.abc import Sequence

CORRECT_AT = 0.5  # a sample counts as correct when its reward reaches this


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that a random k-subset of n samples, c of them correct, holds a correct one.

    ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` so that large
    n neither overflows nor loses precision to huge binomials.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if n < 1 or k < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1, k >= 1 and 0 <= c <= n; got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"k={k} exceeds the number of samples n={n}")
    if n - c < k:  # every k-subset contains a correct sample (covers c == n and n == k, c > 0)
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def summarize(per_prompt_correct: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict[str, float]:
    """``accuracy`` (mean over all samples) and ``pass@k`` for each k (mean over prompts)."""
    if not per_prompt_correct:
        raise ValueError("no prompts to summarize")
    if any(len(samples) == 0 for samples in per_prompt_correct):
        raise ValueError("every prompt needs at least one sample")
    total = sum(len(samples) for samples in per_prompt_correct)
    correct = sum(sum(bool(x) for x in samples) for samples in per_prompt_correct)
    summary = {"accuracy": correct / total}
    for k in ks:
        scores = [pass_at_k(len(s), sum(bool(x) for x in s), k) for s in per_prompt_correct]
        summary[f"pass@{k}"] = sum(scores) / len(scores)
    return summary
