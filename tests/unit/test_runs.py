"""RUN/run.json states as `areal ps` shows them: running, dead (resumable or not), another
host, and the end states written at exit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from areal_cli.launch import runs


def _run_dir(tmp_path: Path, **record) -> Path:
    run_dir = tmp_path / "exp" / "trial"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("experiment_name: exp\n")
    base = {"host": socket.gethostname(), "controller_pid": os.getpid(), "state": "running"}
    runs.write_record(run_dir, {**base, "total_steps": 10, "launcher": "local", **record})
    return run_dir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_states(tmp_path: Path) -> None:
    assert runs.view(_run_dir(tmp_path / "a")).state == "running"  # this process
    dead = _run_dir(tmp_path / "b", controller_pid=_dead_pid())
    assert runs.view(dead).state == "dead"
    (dead / "recover" / "step-3").mkdir(parents=True)
    assert runs.view(dead).state == "dead: areal train --resume"
    elsewhere = _run_dir(tmp_path / "c", host="node-7")
    assert runs.view(elsewhere).state == "running? (on node-7)"
    assert [p.parent.name for p in runs.find_runs(tmp_path / "a")] == ["exp"]


def test_end_record_is_written_only_by_the_controller_that_started(tmp_path: Path) -> None:
    mine = _run_dir(tmp_path / "a")
    (mine / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "loss": 2}\n')
    runs.end_record(mine, 130)
    v = runs.view(mine)
    assert (v.state, v.record["exit_code"], v.step, v.score) == ("stopped", 130, 2, "loss 2.0000")
    other = _run_dir(tmp_path / "b", controller_pid=_dead_pid())
    runs.end_record(other, 0)  # a later controller's record is not ours to end
    assert runs.read_record(other)["state"] == "running"
    lines = runs.ps_lines([mine, other])
    assert lines[1].split()[:6] == ["exp", "trial", "local", "-", "stopped", "2/10"]
    assert not list(mine.glob(".run.json*"))  # written through a temp file, renamed


def test_ps_prints_the_run_argument_and_status_takes_what_ps_names(
    tmp_path: Path, monkeypatch
) -> None:
    """ps's RUN column is what status, logs and stop take; EXPERIMENT/TRIAL, as ps names a
    run, is found under ./runs (the default FILEROOT); anything else says where to look."""
    from tests.conftest import areal_in_process

    monkeypatch.chdir(tmp_path)
    run_dir = _run_dir(tmp_path / "runs")
    (line,) = areal_in_process("ps").stdout.splitlines()[1:]
    assert line.split()[:2] == ["exp", "trial"] and line.split()[-1] == "runs/exp/trial"
    for given in ("runs/exp/trial", "exp/trial", str(run_dir)):
        status = areal_in_process("status", given)
        assert status.returncode == 0 and "running, step 0/10" in status.stdout, given
    missing = areal_in_process("status", "exp/nope")
    assert missing.returncode == 2 and "`areal ps FILEROOT` lists the runs" in missing.stderr
    assert "RUN column" in missing.stderr
