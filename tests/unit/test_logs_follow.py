"""`areal logs RUN -f` on a run that has started but whose controller has not written its
log yet waits for the log (seen on a loaded machine: Slurm listed the job's steps before
the controller's first line, and `logs -f` exited 2 saying there was no such log)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from areal_cli.launch import runs
from tests.conftest import REPO


def _running_run(run_dir: Path) -> None:
    """A run directory whose record says running, with this process as its controller."""
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("experiment_name: exp\n")
    (run_dir / "plan.json").write_text(json.dumps({"processes": [{"name": "trainer"}]}))
    runs.write_record(
        run_dir,
        {"host": socket.gethostname(), "controller_pid": os.getpid(), "state": "running"},
    )


def test_follow_waits_for_a_log_the_run_will_write(tmp_path: Path) -> None:
    run_dir = tmp_path / "exp" / "trial"
    _running_run(run_dir)
    follow = subprocess.Popen(
        [sys.executable, "-m", "areal_cli.cli", "logs", str(run_dir), "-f"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(2.0)
        assert follow.poll() is None, follow.communicate()
        (run_dir / "logs" / "controller.log").write_text("09:00:00 waiting for inference servers\n")
        time.sleep(1.0)
        record = runs.read_record(run_dir)
        runs.write_record(run_dir, {**record, "state": "finished", "exit_code": 0})
        out, err = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert follow.returncode == 0, err
    assert "waiting for inference servers" in out


def test_a_log_the_run_never_writes_is_refused_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "exp" / "trial"
    _running_run(run_dir)
    done = subprocess.run(
        [sys.executable, "-m", "areal_cli.cli", "logs", str(run_dir), "server-7", "-f"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2 and "server-7.log: no such log" in done.stderr, done.stderr
