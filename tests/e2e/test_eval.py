"""`areal eval` through the real CLI: deterministic results, resumable output, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import free_port, run_areal

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
        and "does not exist; give an HF folder" in result.stderr
        and "Traceback" not in result.stderr
    )


def test_a_folder_that_is_no_checkpoint_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("hello")
    result = _eval(tmp_path, tmp_path / "out", "--checkpoint", str(tmp_path / "stuff"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert (
        "is not a checkpoint; give an HF folder" in errors[0] and "RUN/recover/step-N" in errors[0]
    )


def _eval_default_out(tmp_path: Path, *extra: str):
    return run_areal(
        "eval",
        "recipes/tiny_cpu.yaml",
        f"cluster.fileroot={tmp_path / 'runs'}",
        "eval.max_prompts=8",
        "eval.n_samples=2",
        "eval.k=[1,2]",
        f"launcher.inference_base_port={free_port()}",
        *extra,
        timeout=300,
    )


def _summary_line(stdout: str) -> Path:
    """OUT as the CLI prints it ('samples: OUT/samples.jsonl ...')."""
    line = next(line for line in stdout.splitlines() if line.startswith("samples: "))
    return Path(line.split()[1]).parent


def test_two_models_with_one_folder_name_keep_their_own_results(tmp_path: Path) -> None:
    """The demo's warmed-up model and a random one, both in folders named v24: each gets
    its own OUT and its own accuracy; neither OUT accepts the other's samples."""
    import shutil

    from areal_cli.launch import builtins

    warmed = shutil.copytree(builtins.cached("tiny-arith", 1), tmp_path / "a" / "v24")
    noise = shutil.copytree(builtins.cached("tiny", 1), tmp_path / "b" / "v24")
    first = _eval_default_out(tmp_path, "--checkpoint", str(warmed))
    second = _eval_default_out(tmp_path, "--checkpoint", str(noise))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    out_a, out_b = _summary_line(first.stdout), _summary_line(second.stdout)
    assert out_a != out_b and out_a.name.startswith("v24-") and out_b.name.startswith("v24-")
    assert out_a.parent == tmp_path / "runs" / "tiny-cpu" / "eval"  # no run of their own
    acc_a = json.loads((out_a / "summary.json").read_text())["accuracy"]
    acc_b = json.loads((out_b / "summary.json").read_text())["accuracy"]
    assert len(_rows(out_b)) == 16 and acc_a > acc_b + 0.1  # B generated its own samples
    # Into A's folder: another model, or other settings, are refused with one line.
    for extra in (["--checkpoint", str(noise)], ["--checkpoint", str(warmed), "eval.seed=7"]):
        refused = _eval_default_out(tmp_path, "--out", str(out_a), *extra)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error")]
        assert refused.returncode == 2 and len(errors) == 1, refused.stderr
        assert "cannot be mixed" in errors[0] and "Traceback" not in refused.stderr
    assert len(_rows(out_a)) == 16  # untouched
    # The same eval again resumes: nothing left to generate, the same accuracy.
    again = _eval_default_out(tmp_path, "--checkpoint", str(warmed))
    assert again.returncode == 0 and _summary_line(again.stdout) == out_a
    assert json.loads((out_a / "summary.json").read_text())["accuracy"] == acc_a


def test_eval_output_goes_to_the_evaluated_run(tmp_path: Path) -> None:
    """--checkpoint RUN writes under RUN/eval; the initial model's eval creates no run."""
    from areal_cli.launch import builtins
    from areal_cli.rundir import handoff

    run = tmp_path / "runs" / "tiny-cpu" / "demo-x"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("experiment_name: tiny-cpu\n")
    (run / "plan.json").write_text("{}")
    model = builtins.cached("tiny-arith", 1)
    handoff.write_entry(
        run / "weights", "v3", 3, lambda d: [handoff.link_or_copy(p, d) for p in model.iterdir()]
    )
    done = _eval_default_out(tmp_path, "--checkpoint", str(run))
    assert done.returncode == 0, done.stderr
    assert _summary_line(done.stdout).parent == run / "eval"
    initial = _eval_default_out(tmp_path)
    assert initial.returncode == 0, initial.stderr
    assert _summary_line(initial.stdout).parent == tmp_path / "runs" / "tiny-cpu" / "eval"
    assert not (tmp_path / "runs" / "tiny-cpu" / "trial0").exists()  # the recipe's trial
