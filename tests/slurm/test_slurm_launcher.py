"""`launcher.type: slurm` on a real one-host Slurm (two slurmd, "n1" and "n2"): the run
trains as a job whose steps are the servers and the trainer, `areal ps / logs -f / stop`
follow and end it, a controller killed with -9 takes its steps with it and `--resume`
continues as a new job, a "2-node" layout finds its servers through the registry (and takes its weights over
the network), and
`sbatch --test-only` accepts what --dry-run prints."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port, run_areal
from tests.e2e.test_lifecycle import _state
from tests.e2e.test_train import _assert_no_processes_left, _metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.slurm]


def _train_args(fileroot: Path, *extra: str) -> list[str]:
    return [
        "train",
        "recipes/tiny_cpu.yaml",
        "launcher.type=slurm",
        f"cluster.fileroot={fileroot}",
        "logging.display=plain",
        f"launcher.inference_base_port={free_port()}",
        f"launcher.trainer_port={free_port()}",
        *extra,
    ]


def _small(steps: int) -> list[str]:
    return [f"total_train_steps={steps}", "rollout.batch_size=4", "rollout.group_size=2"]


def _submit(fileroot: Path, *extra: str) -> str:
    done = run_areal(*_train_args(fileroot, *extra))
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("submitted Slurm job "), done.stdout
    return first.split()[3]


def _steps(job: str) -> list[tuple[str, str, str]]:
    """(step id, name, nodes) of the job's steps, the batch step included."""
    out = subprocess.run(
        ["squeue", "-h", "-s", "-j", job, "-o", "%i %j %N"], capture_output=True, text=True
    ).stdout
    return [tuple(line.split()) for line in out.splitlines() if len(line.split()) == 3]


def _job_gone(job: str) -> bool:
    """squeue no longer lists the job (ended, or purged: "Invalid job id"). A failed
    squeue (slurmctld busy: "Socket timed out") says nothing: once it was read as gone,
    and a test went on before the run had started."""
    found = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True)
    if found.returncode != 0:
        return "Invalid job id" in found.stderr
    return not found.stdout.strip()


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def _slurm_out(run_dir: Path, job: str) -> str:
    path = run_dir / "logs" / f"slurm-{job}.out"
    return path.read_text() if path.exists() else "(no slurm output)"


def test_a_slurm_run_learns_while_squeue_ps_and_logs_follow_it(
    slurm_cluster: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    job = _submit(tmp_path, "total_train_steps=8")  # the demo recipe, a third of its steps
    seen: set[str] = set()

    def steps_seen() -> bool:
        seen.update(name for _, name, _ in _steps(job))
        return {"batch", "server-0", "trainer"} <= seen or _job_gone(job)

    _wait(steps_seen, 120, "the job's steps in squeue")
    assert {"batch", "server-0", "trainer"} <= seen, _slurm_out(run_dir, job)
    line = _state(tmp_path)
    assert line[:4] == ["tiny-cpu", "trial0", "slurm", job] and line[4] in ("running", "finished")
    follow = subprocess.run(
        [sys.executable, "-m", "areal_cli.cli", "logs", str(run_dir), "-f", "-n", "1000"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert follow.returncode == 0 and "step 8/8" in follow.stdout, follow.stdout[-2000:]
    _wait(lambda: _job_gone(job), 60, "the job to end")
    rewards = [row["reward_mean"] for row in _metrics(run_dir)]
    assert [row["step"] for row in _metrics(run_dir)] == list(range(1, 9))
    assert sum(rewards[-3:]) / 3 >= rewards[0] + 0.3, rewards  # ~0.8 at step 8, from 0.31
    assert _state(tmp_path)[4] == "finished"
    registry = json.loads((run_dir / "registry" / "server-0.json").read_text())
    assert registry["job_id"] == job and registry["node"] == "n1"
    assert registry["host"] == "127.0.0.1"  # n1's NodeAddr, not this machine's hostname
    _assert_no_processes_left(run_dir)


def test_areal_stop_ends_the_job_and_every_step(slurm_cluster: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    job = _submit(tmp_path, *_small(500))
    _wait(lambda: len(_metrics(run_dir)) >= 2 or _job_gone(job), 180, "two steps")
    assert len(_metrics(run_dir)) >= 2, _slurm_out(run_dir, job)
    assert {"server-0", "trainer"} <= {name for _, name, _ in _steps(job)}
    status = run_areal("status", str(run_dir)).stdout
    assert f"slurm job {job}" in status and "on node n1" in status
    stopped = run_areal("stop", str(run_dir), timeout=180)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    assert _job_gone(job) and _steps(job) == []
    assert _state(tmp_path)[4] == "stopped"
    log = (run_dir / "logs" / "controller.log").read_text()
    assert "stopped by SIGTERM" in log and "continue it with: areal train" in log
    # the job's controller got the run's key as an override; its resume line shows none
    assert re.findall(r"inference\.api_key=([^\s']+)", log) == ["<redacted>"]
    _assert_no_processes_left(run_dir)


def test_a_controller_killed_with_9_takes_its_steps_and_resume_is_a_new_job(
    slurm_cluster: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    args = [*_small(10), "recover.freq_steps=2"]
    job = _submit(tmp_path, *args)
    _wait(lambda: len(_metrics(run_dir)) >= 4 or _job_gone(job), 180, "four steps")
    assert len(_metrics(run_dir)) >= 4, _slurm_out(run_dir, job)
    os.kill(int(_record(run_dir)["controller_pid"]), signal.SIGKILL)
    _wait(lambda: _job_gone(job), 60, "Slurm to end the job of the killed controller")
    assert _steps(job) == []  # no orphan step
    _assert_no_processes_left(run_dir)
    assert _state(tmp_path)[4:7] == ["dead:", "areal", "train"]
    again = _submit(tmp_path, *args, "--resume")
    assert again != job
    _wait(lambda: _job_gone(again), 300, "the resumed job to end")
    assert _state(tmp_path)[4] == "finished", _slurm_out(run_dir, again)
    assert [row["step"] for row in _metrics(run_dir)] == list(range(1, 11))
    assert all("reward_mean" in row for row in _metrics(run_dir))
    assert "--resume" in (run_dir / "slurm" / "job.sbatch").read_text()


def test_two_nodes_one_server_each_and_the_trainer_on_both(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """... with the weights over the network: the group's master is the trainer's first
    node as Slurm knows it (NodeAddr), resolved for the trainer and the controller."""
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    two = [
        "cluster.n_nodes=2",
        "allocation_mode=embedded:d2+fsdp:d2",
        "actor.weight_update.method=distributed",
    ]
    job = _submit(tmp_path, *_small(6), *two)
    placed: dict[str, str] = {}

    def all_placed() -> bool:
        placed.update({name: nodes for _, name, nodes in _steps(job)})
        return {"server-0", "server-1", "trainer"} <= set(placed) or _job_gone(job)

    _wait(all_placed, 120, "three steps")
    assert placed.get("server-0") == "n1" and placed.get("server-1") == "n2", placed
    assert placed.get("trainer") == "n[1-2]", placed
    _wait(lambda: _job_gone(job), 300, "the job to end")
    assert _state(tmp_path)[4] == "finished", _slurm_out(run_dir, job)
    nodes = {json.loads(p.read_text())["node"] for p in (run_dir / "registry").glob("*.json")}
    assert nodes == {"n1", "n2"}
    trainer_argv = json.loads((run_dir / "plan.json").read_text())["processes"][2]["argv"]
    assert trainer_argv[trainer_argv.index("--nnodes") + 1] == "2"
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "weight-update group" in trainer_log and "127.0.0.1:" in trainer_log, trainer_log
    for server in ("server-0", "server-1"):  # every version came over the group
        assert (
            "weights swapped to the received version "
            in (run_dir / "logs" / f"{server}.log").read_text()
        )
    _assert_no_processes_left(run_dir)


def test_sbatch_test_only_accepts_the_dry_run_script(slurm_cluster: str, tmp_path: Path) -> None:
    extra = [
        "launcher.slurm.partition=debug",
        "launcher.slurm.time=00:10:00",
        "launcher.slurm.extra_sbatch=[--comment=areal-test]",
        "launcher.slurm.preamble=[echo preamble]",
        "cluster.n_nodes=2",
        "allocation_mode=embedded:d2+fsdp:d2",
    ]
    dry = run_areal(*_train_args(tmp_path, *extra), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    script = json.loads(dry.stdout)["sbatch_script"]
    assert "#SBATCH --nodes=2" in script and "#SBATCH --comment=areal-test" in script
    assert list(tmp_path.iterdir()) == []  # a dry run writes and submits nothing
    path = tmp_path.parent / f"{tmp_path.name}.sbatch"
    path.write_text(script)
    checked = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0 and "to start at" in checked.stderr, checked.stderr
    path.write_text(script.replace("--nodes=2", "--nodes=3"))  # the cluster has two nodes
    assert subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True).returncode


def test_a_killed_server_is_a_new_step_and_a_cancelled_step_ends_the_run(
    slurm_cluster: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    job = _submit(tmp_path, *_small(500))
    _wait(lambda: len(_metrics(run_dir)) >= 2 or _job_gone(job), 180, "two steps")
    entry = json.loads((run_dir / "registry" / "server-0.json").read_text())
    os.kill(entry["pid"], signal.SIGKILL)  # a crash: restarted as a new step
    log = run_dir / "logs" / "controller.log"
    _wait(lambda: "server-0 restarted" in log.read_text() or _job_gone(job), 120, "the restart")
    servers = [s for s in _steps(job) if s[1] == "server-0"]
    assert len(servers) == 1 and servers[0][0] != f"{job}.{entry['step_id']}", _steps(job)
    subprocess.run(["scancel", servers[0][0]], check=True)  # on purpose: the run ends
    _wait(lambda: _job_gone(job), 60, "the job to end")
    assert "server-0's job step was cancelled; stopping every process" in log.read_text()
    assert _state(tmp_path)[4] == "stopped" and _record(run_dir)["exit_code"] == 130
    _assert_no_processes_left(run_dir)
