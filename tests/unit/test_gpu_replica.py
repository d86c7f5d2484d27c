"""scripts/gpu_replica.sh refuses, in one line and with exit 2, what it cannot run with,
before it builds or downloads anything (its build itself downloads ~4 GB: not run here)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO


def _replica(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/gpu_replica.sh", *args],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


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
