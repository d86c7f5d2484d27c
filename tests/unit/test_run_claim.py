"""One controller per run directory: a second `areal train` naming the same run while the
first holds it is refused (exit 2) before it writes anything there."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_cli.rundir.layout import RunClaim, RunInUse
from tests.conftest import run_areal


def test_a_claimed_run_directory_is_refused_until_it_is_released(tmp_path: Path) -> None:
    first = RunClaim(tmp_path / "run")
    with pytest.raises(RunInUse, match="in use by another areal train"):
        RunClaim(tmp_path / "run")
    first.close()
    RunClaim(tmp_path / "run").close()  # free again


def test_train_into_a_run_directory_held_by_another_controller_exits_2(tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny-cpu" / "held"
    claim = RunClaim(run_dir)
    try:
        done = run_areal(
            "train", "recipes/tiny_cpu.yaml", f"cluster.fileroot={tmp_path}", "trial_name=held"
        )
    finally:
        claim.close()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "in use by another areal train" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".controller.lock"]  # nothing written
