"""Submitting a Slurm run from a login node (`areal train R launcher.type=slurm`): what
the module docstring of areal_cli.launch.slurm calls "Submit". Apart from slurm.py because
it needs the run records (launch.runs) and the data check (launch.train), which need
slurm.py themselves."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

from areal_cli.config.loader import LoadedConfig
from areal_cli.launch.plan import LaunchPlan
from areal_cli.launch.slurm import SECRET_ENV, SlurmError, job_command, render_sbatch, run_slurm
from areal_cli.rundir.paths import RunDir


def submit_run(
    loaded: LoadedConfig,
    plan: LaunchPlan,
    recipe: Path,
    overrides: list[str],
    resume: bool,
    echo: Callable[[str], None],
    warn: Callable[[str], None],
    error: Callable[[str], None],
) -> int:
    """Check the data, write the run's files and the batch script, and submit it; returns
    the exit code. FileExistsError or DatasetError before anything is submitted. A
    submission that fails is an error (exit 1), and the run is recorded as failed with
    the reason, which `areal ps` and `status` show."""
    from areal_cli.config.loader import to_yaml
    from areal_cli.launch import runs
    from areal_cli.launch.train import read_data
    from areal_cli.rundir.handoff import write_text_atomic
    from areal_cli.rundir.layout import prepare_run_dir

    cfg = loaded.config
    run_dir = Path(plan.run_dir)
    active = runs.view(run_dir).state
    if runs.is_active(active):
        raise FileExistsError(f"{run_dir} is {active}; `areal stop {run_dir}` first")
    warnings: list[str] = []
    read_data(cfg, warnings.append)
    secret = cfg.inference.api_key or secrets.token_urlsafe(24)
    prepare_run_dir(run_dir, plan.dirs, to_yaml(cfg), plan.to_dict(secret=secret), resume)
    for line in warnings:
        warn(line)
    script = RunDir(run_dir).sbatch
    script.parent.mkdir(parents=True, exist_ok=True)
    command = job_command(recipe, overrides, resume)
    write_text_atomic(script, render_sbatch(cfg, plan, command, os.getcwd()))
    env = {**os.environ, SECRET_ENV: secret}
    try:
        job_id = run_slurm(["sbatch", "--parsable", str(script)], env=env).strip().split(";")[0]
    except SlurmError as exc:
        runs.submitted_record(cfg, run_dir, str(recipe), None, failed=str(exc))
        error(f"{exc}; nothing was submitted: run the same command again once Slurm answers")
        return 1
    runs.submitted_record(cfg, run_dir, str(recipe), job_id)
    echo(f"submitted Slurm job {job_id} for {run_dir} ({script})")
    echo(f"  follow it:  areal logs {run_dir} -f    (or squeue -s -j {job_id})")
    echo(f"  stop it:    areal stop {run_dir}       (or scancel {job_id})")
    return 0
