"""The scripts of a GPU session say how it ended: gpu_session.sh exits 1 when a part
failed (a lent machine's tool reports only the exit code and the output's tail), and
gpu_replica.sh refuses, in one line and with exit 2, what it cannot run with, before it
builds or downloads anything (its build downloads ~4 GB: not run here)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO


def _script(name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`bash scripts/NAME ARGS` from the repository, with `env` added to this one's."""
    return subprocess.run(
        ["bash", f"scripts/{name}", *args],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _replica(*args: str, **env: str) -> subprocess.CompletedProcess:
    return _script("gpu_replica.sh", *args, **env)


def test_without_out_it_prints_its_usage() -> None:
    done = _replica()
    assert done.returncode == 2
    assert done.stderr.strip() == "usage: bash scripts/gpu_replica.sh OUT"


def test_a_python_that_is_not_3_12_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    done = _replica(str(tmp_path / "out"), PY312="python3.11", VENV=str(venv))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith("gpu_replica: no Python 3.12 found")
    assert not venv.exists() and not (tmp_path / "out").exists()


def test_gpu_session_exits_1_when_a_part_fails_and_still_runs_the_other(tmp_path: Path) -> None:
    """A Python that fails at once (`false`): both bench parts run, each logs its exit."""
    done = _script("gpu_session.sh", "bench", str(tmp_path), "--cpu", PYTHON="false")
    assert done.returncode == 1, done.stdout + done.stderr
    for part in ("engine", "trainer"):
        log = (tmp_path / f"bench-{part}.log").read_text()
        assert f"gpu_bench --part {part}: exit 1" in log


def test_gpu_session_refuses_an_unknown_command(tmp_path: Path) -> None:
    done = _script("gpu_session.sh", "benchmark", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip() == "usage: bash scripts/gpu_session.sh check|bench OUT [--cpu]"


def test_a_venv_folder_it_did_not_build_is_left_alone(tmp_path: Path) -> None:
    """It rebuilds only a venv of its own (one with its stamp): another folder named by
    VENV is refused and kept as it was."""
    other = tmp_path / "someones-venv"
    (other / "bin").mkdir(parents=True)
    (other / "bin" / "python").write_text("keep me")
    done = _replica(str(tmp_path / "out"), VENV=str(other))
    assert done.returncode == 2, done.stderr
    assert "is not a venv this script built" in done.stderr
    assert (other / "bin" / "python").read_text() == "keep me"
