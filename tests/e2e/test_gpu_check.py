"""scripts/gpu_check.sh --cpu: the GPU check's steps on the CPU, so that the script is
ready (and known to work) the moment a GPU machine is lent. Its colocated demo is also
the end-to-end test of a colocated run (embedded:d1|fsdp:d1) learning.

The checks run in two groups, one module each, so that the suite's workers run them side
by side (a module is one worker's unit): this one, and test_gpu_check_roles.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def run_gpu_check(only: str) -> list[str]:
    """The table rows of `gpu_check.sh --cpu --only ONLY`; every one must pass."""
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--cpu", "--only", only],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    table = done.stdout[done.stdout.find("gpu_check (--cpu)") :]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = table.splitlines()[2:]
    assert rows and all("  PASS  " in row for row in rows), table
    return rows


def test_gpu_check_passes_on_the_cpu() -> None:
    rows = run_gpu_check("trainer,engine,colocated,throughput")
    assert len(rows) == 6
    table = "\n".join(rows)
    assert "colocated demo" in table and "tokens/s" in table and "trainer: LoRA" in table
