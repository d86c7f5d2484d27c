"""`areal eval` through the real CLI: deterministic results, resumable output, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_cli.evaluation.run import summarize_rows
from tests.conftest import run_areal
from tests.gloo.conftest import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _eval(tmp_path: Path, out: Path, *extra: str):
    return run_areal(
        "eval",
        "recipes/tiny_cpu.yaml",
        f"cluster.fileroot={tmp_path / 'runs'}",
        "eval.max_prompts=12",
        "eval.n_samples=4",
        "eval.k=[1,4]",
        f"launcher.inference_base_port={free_port()}",
        "--out",
        str(out),
        *extra,
        timeout=300,
    )


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_eval_is_deterministic_and_resumable(tmp_path: Path) -> None:
    first = _eval(tmp_path, tmp_path / "a")
    assert first.returncode == 0, first.stderr
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["n_prompts"] == 12 and summary["n_samples"] == 48
    assert {"mean_reward", "accuracy", "pass@1", "pass@4", "elapsed_s"} <= summary.keys()
    second = _eval(tmp_path, tmp_path / "b")
    key = lambda r: (r["prompt_index"], r["sample_index"])  # noqa: E731
    completions_a = {key(r): r["completion"] for r in _rows(tmp_path / "a")}
    completions_b = {key(r): r["completion"] for r in _rows(tmp_path / "b")}
    assert second.returncode == 0 and completions_a == completions_b  # same seed, same samples
    # A rerun into a partly finished OUT only does the missing samples.
    rows = (tmp_path / "a" / "samples.jsonl").read_text().splitlines()
    (tmp_path / "a" / "samples.jsonl").write_text("\n".join(rows[:30]) + "\n")
    again = _eval(tmp_path, tmp_path / "a")
    assert again.returncode == 0
    assert len(_rows(tmp_path / "a")) == 48
    assert {key(r): r["completion"] for r in _rows(tmp_path / "a")} == completions_a


def test_missing_checkpoint_is_bad_input(tmp_path: Path) -> None:
    result = _eval(tmp_path, tmp_path / "out", "--checkpoint", str(tmp_path / "nope"))
    assert (
        result.returncode == 2
        and "checkpoint not found" in result.stderr
        and "Traceback" not in result.stderr
    )


def test_summary_rows() -> None:
    rows = [
        {"prompt_index": p, "sample_index": i, "reward": r, "tokens": 3}
        for p, rs in enumerate([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
        for i, r in enumerate(rs)
    ]
    s = summarize_rows(rows, [1, 4], 1.0)
    assert s["accuracy"] == pytest.approx(5 / 12)
    assert s["pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert s["pass@4"] == pytest.approx((1 + 0 + 1) / 3)
