"""`areal ps / status / logs / stop` on a real local run: they follow it while it runs,
`stop` ends it as Ctrl-C does, and a controller killed with -9 shows as dead and
resumable."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_areal
from tests.e2e.test_train import _args, _assert_no_processes_left, _metrics, _run_dir, _wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _state(fileroot: Path) -> list[str]:
    out = run_areal("ps", str(fileroot)).stdout.splitlines()
    assert out[0].split() == [
        "EXPERIMENT",
        "TRIAL",
        "LAUNCHER",
        "JOB",
        "STATE",
        "STEP",
        "LAST",
        "AGE",
        "RUN",
    ]
    return out[1].split()


def test_ps_status_logs_follow_a_run_and_stop_ends_it(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    args = _args(tmp_path, 200, "recover.freq_steps=1")
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: len(_metrics(run_dir)) >= 2, 300, proc)
        line = _state(tmp_path)
        assert line[:5] == ["tiny-cpu", "trial0", "local", "-", "running"]
        assert line[5].endswith("/200") and line[6] == "reward"
        status = run_areal("status", str(run_dir)).stdout
        assert "running, step" in status and "server-0" in status and "trainer-0  phase:" in status
        assert status.count(" running") >= 3  # the run and both processes
        logs = run_areal("logs", str(run_dir), "-n", "2").stdout.splitlines()
        assert len(logs) == 2 and all("step" in x for x in logs)
        follow = subprocess.Popen(
            [sys.executable, "-m", "areal_cli.cli", "logs", str(run_dir), "trainer", "-f"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert "[trainer]" in follow.stdout.readline() + follow.stdout.readline()
        stopped = run_areal("stop", str(run_dir))
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
        assert proc.wait(timeout=60) == 130
        assert follow.wait(timeout=30) == 0  # -f ends with the run
    finally:
        proc.kill()
    _assert_no_processes_left(run_dir)
    assert _state(tmp_path)[4] == "stopped"
    assert "nothing to stop" in run_areal("stop", str(run_dir)).stdout

    again = subprocess.Popen(
        args + ["--resume"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_for(lambda: _state(tmp_path)[4] == "running", 120, again)
        again.send_signal(signal.SIGKILL)
        again.wait(timeout=10)
    finally:
        again.kill()
    _assert_no_processes_left(run_dir)
    assert _state(tmp_path)[4:7] == ["dead:", "areal", "train"]
    assert "gone" in run_areal("status", str(run_dir)).stdout
    bad = run_areal("logs", str(tmp_path))
    assert bad.returncode == 2 and "not a run directory" in bad.stderr
