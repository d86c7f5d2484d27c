"""`areal train` end to end through the real CLI: servers, torchrun trainer, handoffs.

Every test runs the tiny CPU recipe for a few steps in a temporary run directory with
free ports, then checks the run directory and that no process of the run is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_cli.rundir import handoff
from tests.conftest import REPO, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REQUIRED = (
    "step",
    "weight_version",
    "reward_mean",
    "reward_std",
    "staleness_mean",
    "staleness_max",
    "gen_tokens",
    "gen_tokens_per_s",
    "trainer_step_s",
    "trainer_wait_s",
    "controller_wait_s",
    "handoff_save_s",
    "handoff_load_s",
    "loss",
    "grad_norm",
    "clip_frac",
    "imp_weight_mean",
    "padding_fraction",
)


def _args(tmp_path: Path, steps: int, *extra: str) -> list[str]:
    base = free_port()
    return [
        sys.executable,
        "-m",
        "areal_cli.cli",
        "train",
        "recipes/tiny_cpu.yaml",
        f"cluster.fileroot={tmp_path}",
        f"total_train_steps={steps}",
        "logging.display=plain",
        f"launcher.inference_base_port={base}",
        f"launcher.trainer_port={free_port()}",
        "rollout.batch_size=4",
        "rollout.group_size=2",
        *extra,
    ]


def _run_dir(tmp_path: Path) -> Path:
    return tmp_path / "tiny-cpu" / "trial0"


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line]
        if path.exists()
        else []
    )


def _metrics(run_dir: Path) -> list[dict]:
    """The step lines of metrics.jsonl."""
    return [r for r in _rows(run_dir) if r.get("kind") != "eval"]


def _evals(run_dir: Path) -> list[dict]:
    """The eval rows of metrics.jsonl (eval.freq_steps)."""
    return [r for r in _rows(run_dir) if r.get("kind") == "eval"]


def _processes_of(run_dir: Path) -> list[int]:
    """PIDs whose command line mentions the run directory (servers, torchrun, ranks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmdline:
            pids.append(int(entry.name))
    return pids


def _assert_no_processes_left(run_dir: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while _processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_of(run_dir) == [], "processes of the run were left behind"


def _wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"areal exited early with {proc.returncode}: {out}{err}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_the_demo_learns_and_leaves_a_complete_run_directory(tmp_path: Path) -> None:
    """The demo recipe as shipped (batch and group size, max_staleness 1), for half its
    steps: every metric on every line, the handoffs, the files of the run directory, and
    the mean reward of the last 5 steps well above the first step's. It evaluates every 4
    steps on 64 prompts held out of its training data: the accuracy rises."""
    args = _args(tmp_path, 12)
    args = args[: args.index("rollout.batch_size=4")]  # keep the recipe's batch shape
    args += ["eval.freq_steps=4", "eval.dataset.path=", "eval.holdout=64"]
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = _run_dir(tmp_path)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        assert row["staleness_max"] <= 1
        assert 0.5 < row["imp_weight_mean"] < 2.0  # server logprobs agree with the trainer's
    assert handoff.latest(run_dir / "weights", "v").version == 12
    assert (run_dir / "config.yaml").exists() and (run_dir / "plan.json").exists()
    assert (run_dir / "reward_curve.png").stat().st_size > 1000
    assert list((run_dir / "tensorboard").iterdir())
    assert "step 12/12" in result.stdout
    rewards = [r["reward_mean"] for r in rows]
    assert sum(rewards[-5:]) / 5 >= rewards[0] + 0.3, rewards
    evals = _evals(run_dir)
    assert [(e["step"], e["weight_version"], e["eval_samples"]) for e in evals] == [
        (4, 4, 256), (8, 8, 256), (12, 12, 256)
    ]  # fmt: skip
    accuracy = [e["eval_accuracy"] for e in evals]
    assert accuracy[-1] >= accuracy[0] + 0.1, accuracy
    _assert_no_processes_left(run_dir)


def test_the_multi_turn_recipe_trains(tmp_path: Path) -> None:
    base = free_port()
    args = [
        sys.executable, "-m", "areal_cli.cli", "train", "recipes/tiny_multiturn.yaml",
        f"cluster.fileroot={tmp_path}", "total_train_steps=3", "logging.display=plain",
        f"launcher.inference_base_port={base}", f"launcher.trainer_port={free_port()}",
    ]  # fmt: skip
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "tiny-multiturn" / "trial0"
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3]
    _assert_no_processes_left(run_dir)


def test_resume_after_kill_9_of_the_controller(tmp_path: Path) -> None:
    args = _args(
        tmp_path, 6, "recover.freq_steps=1", "rollout.max_staleness=1",
        "eval.freq_steps=2", "eval.dataset.path=", "eval.holdout=8",
    )  # fmt: skip
    run_dir = _run_dir(tmp_path)
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(
            lambda: len(_metrics(run_dir)) >= 2 and handoff.latest(run_dir / "recover", "step-"),
            300,
            proc,
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    _assert_no_processes_left(run_dir)  # children die with the controller
    recovered = handoff.latest(run_dir / "recover", "step-").version
    again = subprocess.run(
        args + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=400
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all("reward_mean" in r for r in rows)  # a line finished after the kill keeps them
    # each evaluation once: none repeated, none lost to the kill
    assert [e["step"] for e in _evals(run_dir)] == [2, 4, 6]
    # The trainer resumed from exactly the newest recover entry left by the killed run.
    resumed = (
        f"resumed from {run_dir / 'recover' / f'step-{recovered}'}: {recovered} steps done, "
        f"going on with step {recovered + 1}"
    )
    assert resumed in (run_dir / "logs" / "trainer.log").read_text()
    _assert_no_processes_left(run_dir)


@pytest.mark.parametrize("how", ["ctrl-c", "kill-server", "kill-trainer-rank"])
def test_teardown_leaves_no_process(tmp_path: Path, how: str) -> None:
    run_dir = _run_dir(tmp_path)
    # no restarts: a dead process stops the run (tests/e2e/test_relaunch.py restarts them)
    args = _args(tmp_path, 200, "launcher.restarts.trainer=0", "launcher.restarts.server=0")
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: len(_metrics(run_dir)) >= 1, 300, proc)
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        else:
            marker = (
                "areal_cli.inference.server" if how == "kill-server" else "areal_cli.trainer.main"
            )
            victims = [
                p
                for p in _processes_of(run_dir)
                if marker in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                and "torchrun"
                not in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
            ]
            assert victims
            os.kill(victims[-1], signal.SIGKILL)
        # The controller ends (its wind-down is bounded by launcher.stop_timeout_s), and
        # then nothing it started holds its output open: two failures told apart.
        proc.wait(timeout=60)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    if how == "ctrl-c":
        assert proc.returncode == 130
        assert "stopped by SIGINT; every process of the run has ended" in err
        assert "error:" not in err
    else:
        assert proc.returncode == 1
        name = "server-0" if how == "kill-server" else "trainer"
        assert f"{name} exited" in err and f"logs/{name}.log" in err, err
    _assert_no_processes_left(run_dir)


def test_a_stuck_trainer_rank_is_named_and_the_run_resumes(tmp_path: Path) -> None:
    """A rank that stops inside a step (test-only fault hook) ends the run by itself."""
    limit = 15
    two_ranks = "allocation_mode=embedded:d1+fsdp:d2"  # the demo's trainer has one rank
    args = _args(
        tmp_path, 4, "recover.freq_steps=1", f"launcher.watchdog.timeout_s={limit}", two_ranks
    )
    run_dir = _run_dir(tmp_path)
    env = {**os.environ, "AREAL_FAULT_HANG": "trainer-1:step 2: train mb 1/"}
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=400, env=env)
    ended = time.time()
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    err = " ".join(result.stderr.split())  # the display may wrap long lines
    assert "run stuck" in err, err
    assert "rank 1 is stuck outside any collective in 'step 2: train mb 1/" in err, err
    assert "rank 0 waits for it in a collective" in err, err
    hung_since = json.loads((run_dir / "heartbeat" / "trainer-1.json").read_text())["since"]
    assert ended - hung_since < limit + 15  # the limit, the stack dumps and the teardown
    _assert_no_processes_left(run_dir)
    again = subprocess.run(
        args + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=400
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3, 4]
    _assert_no_processes_left(run_dir)


def test_a_frozen_server_is_named(tmp_path: Path) -> None:
    """A server that stops answering (SIGSTOP) while it holds requests ends the run."""
    run_dir = _run_dir(tmp_path)
    args = _args(tmp_path, 200, "launcher.watchdog.timeout_s=10")
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: len(_metrics(run_dir)) >= 2, 300, proc)
        server = [
            p
            for p in _processes_of(run_dir)
            if b"areal_cli.inference.server" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        os.kill(server[0], signal.SIGSTOP)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = " ".join(err.split())
    assert proc.returncode == 1, err[-3000:]
    assert "run stuck: no rollout progress" in err, err[-3000:]
    assert "server-0 holds" in err and "answered none" in err, err[-3000:]
    assert "not answering /health: server-0" in err, err[-3000:]
    assert "the trainer waits in 'wait for rollouts/step-" in err, err[-3000:]
    _assert_no_processes_left(run_dir)


def test_a_recipe_runs_as_the_readme_types_it_with_no_overrides(tmp_path: Path) -> None:
    """`areal train RECIPE` alone (Typer passes no overrides as None), here a colocated
    recipe of a few steps built on the shipped one, into ./runs of the working folder."""
    (tmp_path / "recipe.yaml").write_text(
        "# Usage: areal train recipe.yaml\n"
        f"defaults:\n  - {REPO}/recipes/tiny_cpu_colocated.yaml\n"
        "total_train_steps: 2\n"
        "rollout: {batch_size: 4, group_size: 2, max_concurrent_rollouts: 4}\n"
        "logging: {display: plain}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "areal_cli.cli", "train", "recipe.yaml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    metrics = tmp_path / "runs" / "tiny-cpu-colocated" / "trial0" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["colocated"] == 1 for r in rows)
