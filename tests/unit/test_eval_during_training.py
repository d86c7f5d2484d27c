"""Evaluation during training (areal_cli.rollout.evaluation) without processes: the row,
when a version is due, the held-out split, the rules, and how eval rows live beside the
step lines of metrics.jsonl (not steps; trimmed with the steps a resume redoes)."""

from __future__ import annotations

import json
from pathlib import Path

from areal_cli.data.prompts import Prompt
from areal_cli.launch.train import hold_out
from areal_cli.rollout.evaluation import Evaluator, eval_rows, summarize
from areal_cli.rollout.metrics import steps_in
from areal_cli.rundir.layout import trim_after
from tests.conftest import run_areal


def test_the_row_of_an_evaluation() -> None:
    # prompt 0: 2 of 4 correct; prompt 1: 0 of 4 (rewards >= 0.5 count as correct)
    row = summarize(8, {0: [1.0, 0.0, 0.5, 0.2], 1: [0.0, 0.0, 0.1, 0.4]}, [1, 4])
    assert row["kind"] == "eval" and row["step"] == row["weight_version"] == 8
    assert row["eval_accuracy"] == 2 / 8 and row["eval_prompts"] == 2 and row["eval_samples"] == 8
    assert row["eval_reward_mean"] == sum([1.0, 0.5, 0.2, 0.1, 0.4]) / 8
    assert row["eval_pass@1"] == (0.5 + 0.0) / 2 and row["eval_pass@4"] == (1.0 + 0.0) / 2


def test_a_version_is_due_once_at_each_multiple_of_freq_steps() -> None:
    evaluator = Evaluator(None, 4, [], None, None, None, Path("/nonexistent"), done={4})
    assert [v for v in range(13) if evaluator.due(v)] == [8, 12]  # v0 (the start) is not


def test_the_holdout_is_drawn_with_the_seed_and_never_trained_on() -> None:
    prompts = [Prompt(i, [i], str(i), {}) for i in range(20)]
    train, held = hold_out(prompts, 5, seed=3)
    again, held_again = hold_out(prompts, 5, seed=3)
    assert held == held_again and train == again and len(held) == 5
    assert {p.index for p in train}.isdisjoint(p.index for p in held)
    assert sorted(p.index for p in train + held) == list(range(20))
    assert hold_out(prompts, 5, seed=4)[1] != held


def test_eval_rows_are_not_steps_and_go_with_the_steps_a_resume_redoes(tmp_path: Path) -> None:
    lines = [{"step": 1}, {"step": 2}, {"kind": "eval", "step": 2}, {"step": 3}]
    lines += [{"step": 4}, {"kind": "eval", "step": 4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert steps_in(tmp_path / "metrics.jsonl") == {1, 2, 3, 4}
    assert set(eval_rows(tmp_path / "metrics.jsonl")) == {2, 4}
    trim_after(tmp_path, 3)  # recover/step-3: steps 4.. are redone, and v4 evaluated again
    assert set(eval_rows(tmp_path / "metrics.jsonl")) == {2}
    assert steps_in(tmp_path / "metrics.jsonl") == {1, 2, 3}


def test_the_eval_keys_are_checked() -> None:
    none = run_areal("validate", "recipes/tiny_cpu.yaml", "eval.freq_steps=4", "eval.dataset.path=")
    assert (
        none.returncode == 2
        and "eval.freq_steps: evaluates during training, but there are no eval prompts"
        in none.stderr
    )
    both = run_areal("validate", "recipes/tiny_cpu.yaml", "eval.freq_steps=4", "eval.holdout=8")
    assert (
        both.returncode == 2
        and "eval.holdout: holds 8 training prompts out, but eval.dataset.path" in both.stderr
    )
    ok = run_areal(
        "validate", "recipes/tiny_cpu.yaml", "eval.freq_steps=4", "eval.dataset.path=",
        "eval.holdout=8",
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr


def test_the_eval_section_drives_a_supervised_roles_held_out_loss() -> None:
    from areal_cli.config.loader import load_config
    from areal_cli.config.role_sections import supervised_eval

    own = load_config("recipes/tiny_sft.yaml").config
    assert supervised_eval(own) == (own.sft.eval_path, own.sft.eval_freq_steps)
    shared = load_config(
        "recipes/tiny_sft.yaml",
        ["sft.eval_path=", "eval.dataset.path=recipes/data/arith_test.jsonl", "eval.freq_steps=3"],
    ).config
    path, freq = supervised_eval(shared)
    assert path.endswith("recipes/data/arith_test.jsonl") and freq == 3
    ok = run_areal(
        "validate", "recipes/tiny_sft.yaml", "sft.eval_path=",
        "eval.dataset.path=recipes/data/arith_test.jsonl", "eval.freq_steps=3",
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    both = run_areal(
        "validate", "recipes/tiny_sft.yaml", "eval.dataset.path=recipes/data/arith_test.jsonl"
    )
    assert both.returncode == 2 and "eval.dataset.path: and sft.eval_path" in both.stderr
    rl_only = run_areal("validate", "recipes/tiny_sft.yaml", "eval.n_samples=4")
    assert rl_only.returncode == 2 and "eval: is not used by algorithm: sft" in rl_only.stderr
