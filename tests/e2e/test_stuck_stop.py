"""Ctrl-C ends a run in bounded time even when the controller's loop cannot unwind.

The recipe's own workflow (code that runs inside the controller) blocks when its episode
is cancelled, as a workflow that catches cancellation and waits on something would; its
episodes after step 1's wait, so some are in flight when Ctrl-C comes. After
launcher.stop_timeout_s the controller names where it was stuck, kills every process of
the run and exits 130; the run record says interrupted. tests/e2e/test_train.py covers the
ordinary Ctrl-C, which unwinds in about a second.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.e2e.test_train import _assert_no_processes_left, _metrics, _wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STUBBORN = """
import asyncio
import time

from areal_cli.rollout.workflows import single_turn

started = 0


async def run_episode(client, sample):
    global started
    started += 1
    if started <= 8:  # step 1's batch (4 prompts x 2)
        return await single_turn(client, sample)
    try:
        await asyncio.sleep(3600)  # the later episodes are in flight when the stop comes
    except asyncio.CancelledError:
        time.sleep(3600)  # blocks the controller's event loop: the stop cannot unwind
        raise
"""


def test_a_stop_that_cannot_unwind_is_named_and_forced(tmp_path: Path) -> None:
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"defaults:\n  - {REPO / 'recipes' / 'tiny_cpu.yaml'}\n"
        "rollout:\n  workflow: stubborn:run_episode\n"
    )
    args = [
        sys.executable, "-m", "areal_cli.cli", "train", str(recipe),
        f"cluster.fileroot={tmp_path}", "total_train_steps=200", "logging.display=plain",
        f"launcher.trainer_port={free_port()}", "rollout.batch_size=4", "rollout.group_size=2",
        "rollout.max_concurrent_rollouts=8", "launcher.stop_timeout_s=3",
    ]  # fmt: skip
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: len(_metrics(run_dir)) >= 1, 300, proc)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("error: the stop did not finish within 3 s; the controller was in ")
    assert "stubborn.py:" in line and "in run_episode" in line, line  # the recipe's code
    stack_file = run_dir / "logs" / "controller.stop-stack"
    assert str(stack_file) in line and "continue it with: areal train" in line, line
    assert "time.sleep(3600)" in stack_file.read_text()
    assert took < 3 + 20, took  # the deadline, then a kill of every child (2 s grace)
    _assert_no_processes_left(run_dir)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["exit_code"] == 130, record
