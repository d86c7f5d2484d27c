"""pass@k against brute-force enumeration of k-subsets, edge cases, and the summary."""

from itertools import combinations

import pytest

from areal_cli.rollout.passk import pass_at_k, summarize


def reference_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of k-subsets of n samples (the first c correct) holding at least one correct one."""
    samples = [i < c for i in range(n)]
    subsets = list(combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


CASES = [(n, c, k) for n in range(1, 9) for c in range(n + 1) for k in range(1, n + 1)]


@pytest.mark.parametrize(("n", "c", "k"), CASES)
def test_matches_enumeration(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(reference_pass_at_k(n, c, k), abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(12, 3, 4), (10, 1, 5), (11, 6, 3)])
def test_matches_enumeration_larger(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(reference_pass_at_k(n, c, k), abs=1e-12)


def test_edge_cases() -> None:
    assert pass_at_k(5, 0, 1) == 0.0  # none correct
    assert pass_at_k(5, 0, 5) == 0.0  # none correct, n == k
    assert pass_at_k(5, 5, 1) == 1.0  # all correct
    assert pass_at_k(5, 1, 5) == 1.0  # n == k with one correct
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 is c / n


def test_large_n_is_stable() -> None:
    # C(1000, 500) overflows a float; the product form does not.
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 500, 500) == pytest.approx(1.0)
    assert 0.0 < pass_at_k(1000, 1, 10) == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("n", "c", "k"),
    [(3, 1, 4), (3, 1, 0), (0, 0, 1), (3, 4, 1), (3, -1, 1), (3.0, 1, 1), (3, True, 1)],
)
def test_invalid_arguments(n: object, c: object, k: object) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)  # type: ignore[arg-type]


def test_summarize() -> None:
    correct = [[True, False, False, False], [True, True, True, True], [False] * 4]
    out = summarize(correct, [1, 4])
    assert out["accuracy"] == pytest.approx(5 / 12)
    assert out["pass@1"] == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    assert out["pass@4"] == pytest.approx((1.0 + 1.0 + 0.0) / 3)
    assert set(out) == {"accuracy", "pass@1", "pass@4"}


def test_summarize_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        summarize([[True, False]], [3])
    with pytest.raises(ValueError):
        summarize([], [1])
    with pytest.raises(ValueError):
        summarize([[True], []], [1])


def test_summary_rows() -> None:
    from areal_cli.evaluation.run import summarize_rows

    rows = [
        {"prompt_index": p, "sample_index": i, "reward": r, "tokens": 3}
        for p, rs in enumerate([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
        for i, r in enumerate(rs)
    ]
    s = summarize_rows(rows, [1, 4], 1.0)
    assert s["accuracy"] == pytest.approx(5 / 12)
    assert s["pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert s["pass@4"] == pytest.approx((1 + 0 + 1) / 3)
