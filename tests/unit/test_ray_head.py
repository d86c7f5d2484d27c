"""The local Ray head's guard (areal_cli.launch.ray_head) ends its whole process group,
processes that ignore SIGTERM included (as Ray's agents do), when its parent is killed
with -9 or when it is sent SIGTERM, and removes Ray's temp dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# A command standing in for `ray start --block`: a child that ignores SIGTERM, in the
# guard's process group, which writes its pid.
STUBBORN = "trap '' TERM; sleep 300 & echo $! > {pids}; wait"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        assert time.monotonic() < deadline, f"{pid} still alive"
        time.sleep(0.1)


def _guard(tmp_path: Path) -> list[str]:
    temp = tmp_path / "ray-temp"
    temp.mkdir()
    pids = tmp_path / "pids"
    command = ["sh", "-c", STUBBORN.format(pids=pids)]
    return [
        sys.executable,
        "-m",
        "areal_cli.launch.ray_head",
        "--remove",
        str(temp),
        "--",
        *command,
    ]


def _sleeper(tmp_path: Path) -> int:
    path = tmp_path / "pids"
    deadline = time.monotonic() + 10
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(path.read_text())


def test_a_parent_killed_with_9_takes_the_group(tmp_path: Path) -> None:
    spawn = (
        "import subprocess, sys, time; "
        f"subprocess.Popen({_guard(tmp_path)!r}, start_new_session=True); time.sleep(300)"
    )
    parent = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        sleeper = _sleeper(tmp_path)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        _wait_gone(sleeper)
        deadline = time.monotonic() + 10
        while (tmp_path / "ray-temp").exists():
            assert time.monotonic() < deadline, "the temp dir was not removed"
            time.sleep(0.1)
    finally:
        parent.kill()


def test_sigterm_stops_the_group_and_the_guard(tmp_path: Path) -> None:
    guard = subprocess.Popen(_guard(tmp_path), start_new_session=True)
    try:
        sleeper = _sleeper(tmp_path)
        guard.terminate()
        assert guard.wait(timeout=15) in (0, -signal.SIGKILL)
        _wait_gone(sleeper)
        assert not (tmp_path / "ray-temp").exists()
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)
