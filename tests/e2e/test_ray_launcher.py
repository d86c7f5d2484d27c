"""`launcher.type: ray` on a real local Ray that areal starts on 127.0.0.1: the demo
learns, `areal ps / status / logs -f` follow it, a killed server comes back, `areal stop`
ends it, and a controller killed with -9 takes every Ray process with it (and `--resume`
goes on)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_areal
from tests.e2e.test_lifecycle import _state
from tests.e2e.test_train import _args, _assert_no_processes_left, _metrics, _wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="Ray tests skipped: ray is not installed (pip install -e '.[dev]' installs it)",
    ),
]


def _ray_processes() -> list[str]:
    """Command lines of Ray's processes on this machine (a local Ray areal started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd or "areal-ray-" in cmd:
            found.append(cmd[:120])
    return found


def _assert_ray_gone(timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _ray_processes() == [], _ray_processes()
    assert not list(Path("/tmp").glob("areal-ray-*")), "Ray's temp dir was left behind"


def test_a_ray_run_learns_and_is_followed(tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    args = [sys.executable, "-m", "areal_cli.cli", "train", "recipes/tiny_cpu.yaml"]
    args += ["launcher.type=ray", f"cluster.fileroot={tmp_path}", "logging.display=plain"]
    args += ["total_train_steps=12"]  # half the demo (the whole demo is test_train's)
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(lambda: len(_metrics(run_dir)) >= 1, 300, proc)
        assert _state(tmp_path)[2:5] == ["ray", "-", "running"]
        status = run_areal("status", str(run_dir)).stdout
        assert "server-0" in status and "(server at 127.0.0.1:" in status
        follow = run_areal("logs", str(run_dir), "-f", "-n", "1000", timeout=600)
        assert follow.returncode == 0 and "step 12/12" in follow.stdout
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    rewards = [row["reward_mean"] for row in _metrics(run_dir)]
    assert len(rewards) == 12 and sum(rewards[-5:]) / 5 >= 0.75, rewards
    assert _state(tmp_path)[4] == "finished"
    registry = json.loads((run_dir / "registry" / "server-0.json").read_text())
    assert registry["host"] == "127.0.0.1"  # Ray pinned to loopback
    assert "Ray runtime started" in (run_dir / "logs" / "ray-head.log").read_text()
    _assert_no_processes_left(run_dir)
    _assert_ray_gone()
    assert not (Path.home() / ".ray").exists()  # the token was never written under ~


def test_ray_restart_stop_and_a_controller_killed_with_9(tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    args = _args(tmp_path, 200, "launcher.type=ray", "recover.freq_steps=1")
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: len(_metrics(run_dir)) >= 2, 300, proc)
        entry = json.loads((run_dir / "registry" / "server-0.json").read_text())
        os.kill(entry["pid"], signal.SIGKILL)  # restarted in a new actor of its bundle
        log = run_dir / "logs" / "controller.log"
        _wait_for(lambda: "server-0 restarted" in log.read_text(), 120, proc)
        done = len(_metrics(run_dir))
        _wait_for(lambda: len(_metrics(run_dir)) >= done + 1, 120, proc)
        stopped = run_areal("stop", str(run_dir), timeout=120)
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    _assert_no_processes_left(run_dir)
    _assert_ray_gone()
    assert _state(tmp_path)[4] == "stopped"

    again = subprocess.Popen(
        args + ["--resume"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        done = len(_metrics(run_dir))
        _wait_for(lambda: len(_metrics(run_dir)) >= done + 2, 300, again)
        os.kill(again.pid, signal.SIGKILL)
        again.wait(timeout=10)
    finally:
        again.kill()
    _assert_no_processes_left(run_dir)
    _assert_ray_gone()
    assert _state(tmp_path)[4:7] == ["dead:", "areal", "train"]
