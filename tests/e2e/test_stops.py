"""Stops and resumes say what happened: a stop that was asked for (here SIGHUP, as when
the terminal closes) is no error and prints the command that continues the run; --resume
says where it resumes from; resuming a finished run does nothing; a reader that closes
stdout (`areal train ... | head -3`) does not end the run. `ps` and `status` agree."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, run_areal
from tests.e2e.test_lifecycle import _state
from tests.e2e.test_train import _args, _assert_no_processes_left, _metrics, _run_dir, _wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _status_state(run_dir: Path) -> str:
    first = run_areal("status", str(run_dir)).stdout.splitlines()[0]
    return first.split(": ", 1)[1].split(",")[0]


def test_sighup_stops_cleanly_and_resume_says_where_it_goes_on(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    args = _args(tmp_path, 6, "recover.freq_steps=1")
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: len(_metrics(run_dir)) >= 2, 300, proc)
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    assert "stopped by SIGHUP; every process of the run has ended" in err
    assert "continue it with: areal train recipes/tiny_cpu.yaml " in err and "--resume" in err
    assert "error:" not in err
    _assert_no_processes_left(run_dir)
    assert _state(tmp_path)[4] == "stopped" == _status_state(run_dir)

    resumed = subprocess.run(args + ["--resume"], cwd=REPO, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resuming {run_dir} from recover/step-" in resumed.stdout
    assert [m["step"] for m in _metrics(run_dir)] == list(range(1, 7))
    assert _state(tmp_path)[4] == "finished" == _status_state(run_dir)

    server_log = (run_dir / "logs" / "server-0.log").read_text()
    record = (run_dir / "run.json").read_text()
    again = subprocess.run(args + ["--resume"], cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert f"{run_dir} already finished its 6 steps: nothing to do" in again.stdout
    assert "waiting for inference servers" not in again.stdout
    assert (run_dir / "logs" / "server-0.log").read_text() == server_log  # none started
    assert (run_dir / "run.json").read_text() == record


def test_a_closed_stdout_does_not_end_the_run(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    proc = subprocess.Popen(
        _args(tmp_path, 6), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        head = [proc.stdout.readline() for _ in range(3)]  # as `| head -3` reads
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert all(head), head
    assert proc.returncode == 0, err
    assert "stdout was closed (its reader exited); the run goes on" in err
    assert [m["step"] for m in _metrics(run_dir)] == list(range(1, 7))
    assert json.loads((run_dir / "run.json").read_text())["state"] == "finished"
    assert _state(tmp_path)[4] == "finished" == _status_state(run_dir)
    assert "stdout was closed" in (run_dir / "logs" / "controller.log").read_text()
