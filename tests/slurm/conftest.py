"""A real one-host Slurm for the launcher tests (tests/slurm/cluster.sh), up for the whole
session. Without root or without Debian's slurm-wlm and munge, the tests skip and say why
(.ci/run installs the packages)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

CLUSTER = Path(__file__).with_name("cluster.sh")
STATE = os.environ.get("AREAL_SLURM_DIR", "/tmp/areal-slurm")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel")


def _why_not() -> str:
    if os.geteuid() != 0:
        return "the test Slurm runs its daemons as root, and this is not root"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not found: apt-get install -y slurm-wlm munge (.ci/run does)"
    return ""


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[str]:
    """SLURM_CONF of a running test cluster (started here unless already up; stopped
    at the end only when started here)."""
    why = _why_not()
    if why:
        pytest.skip(f"Slurm tests skipped: {why}")
    conf = f"{STATE}/slurm.conf"
    already = Path(f"{STATE}/slurmctld.pid").exists()
    env = {**os.environ, "AREAL_SLURM_DIR": STATE}
    up = subprocess.run([str(CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, f"tests/slurm/cluster.sh up failed:\n{up.stdout}{up.stderr}"
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if not already:
            subprocess.run([str(CLUSTER), "down"], env=env, capture_output=True, timeout=120)
