"""The Slurm launcher's pure parts: the batch script, the multi-node plan, the job-step
command lines, and servers found through the registry (the real engine runs in
tests/slurm)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_cli.launch.plan import HEAD_NODE
from areal_cli.launch.slurm import SECRET_ENV, SlurmRunner, job_command, render_sbatch
from areal_cli.launch.train import server_addresses
from areal_cli.rundir import registry
from tests.unit.test_plan import _plan


def test_the_batch_script_holds_the_options_and_never_the_key() -> None:
    cfg, _, plan = _plan(
        "tiny_cpu.yaml",
        "launcher.type=slurm",
        "launcher.slurm.partition=cpu",
        "launcher.slurm.account=lab",
        "launcher.slurm.time=1-00:00:00",
        "launcher.slurm.extra_sbatch=[--constraint=fast, --mail-type=END]",
        "launcher.slurm.preamble=[module load python, source .venv/bin/activate]",
        "inference.api_key=s3cret",
    )
    command = job_command(Path("recipes/tiny_cpu.yaml"), ["inference.api_key=s3cret"], True)
    script = render_sbatch(cfg, plan, command, "/work")
    lines = script.splitlines()
    sbatch = [line.split(" ", 1)[1] for line in lines if line.startswith("#SBATCH ")]
    assert sbatch[:4] == [
        "--job-name=areal-tiny-cpu-trial0",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
    ]
    for option in ("--partition=cpu", "--account=lab", "--time=1-00:00:00", "--chdir=/work"):
        assert option in sbatch
    assert sbatch[-2:] == ["--constraint=fast", "--mail-type=END"]
    assert lines.index("module load python") < lines.index("source .venv/bin/activate")
    assert lines[-1].startswith("exec ") and "s3cret" not in script
    assert f'inference.api_key="${SECRET_ENV}"' in lines[-1]
    assert lines[-1].endswith("--in-allocation --resume")


def test_two_gpu_nodes_servers_on_the_first_trainer_on_the_second() -> None:
    _, _, plan = _plan(
        "gsm8k_grpo.yaml",
        "launcher.type=slurm",
        "cluster.n_nodes=2",
        "allocation_mode=sglang:d8+fsdp:d8",
    )
    servers, trainer = plan.processes[:-1], plan.processes[-1]
    assert all(s.nodes == [0] for s in servers)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in servers] == [str(i) for i in range(8)]
    assert "0.0.0.0" in servers[0].argv  # reached from the controller's node
    assert trainer.nodes == [1] and trainer.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    argv = trainer.argv
    assert argv[argv.index("--nnodes") + 1] == "1"
    assert argv[argv.index("--rdzv-endpoint") + 1] == f"{HEAD_NODE}:29500"


def test_two_cpu_nodes_split_servers_and_trainer_ranks() -> None:
    _, _, plan = _plan(
        "tiny_cpu.yaml",
        "launcher.type=slurm",
        "cluster.n_nodes=2",
        "allocation_mode=embedded:d2+fsdp:d4",
        "rollout.batch_size=8",
    )
    assert [p.nodes for p in plan.processes] == [[0], [1], [0, 1]]
    argv = plan.processes[-1].argv
    assert argv[argv.index("--nnodes") + 1] == "2"
    assert argv[argv.index("--nproc-per-node") + 1] == "2"


def test_the_local_plan_stays_on_loopback() -> None:
    _, _, plan = _plan("tiny_cpu.yaml")
    server, trainer = plan.processes
    assert server.argv[server.argv.index("--host") + 1] == "127.0.0.1"
    assert "--standalone" in trainer.argv  # torchrun's rendezvous on a free local port
    _, _, plan = _plan("tiny_cpu.yaml", "launcher.trainer_port=29600")
    trainer = plan.processes[-1]
    assert trainer.argv[trainer.argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:29600"


def _runner(tmp_path: Path, nodes: list[str]) -> SlurmRunner:
    runner = SlurmRunner.__new__(SlurmRunner)  # no job here: only the command lines
    runner.children, runner.nodes, runner.run_dir = [], nodes, tmp_path
    runner.srun_args = ["--container-image=x"]
    runner.node_address = lambda node: f"addr-of-{node}"
    return runner


def test_each_process_becomes_a_job_step_on_its_nodes(tmp_path: Path) -> None:
    _, _, plan = _plan(
        "tiny_cpu.yaml", "launcher.type=slurm", "cluster.n_nodes=2",
        "allocation_mode=embedded:d2+fsdp:d2",
    )  # fmt: skip
    runner = _runner(tmp_path, ["n1", "n2"])
    server1, trainer = plan.processes[1], plan.processes[2]
    step = runner.command(server1, server1.argv)
    assert step[:8] == [
        "srun", "--overlap", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
        "--nodelist=n2", "--job-name=server-1", "--kill-on-bad-exit=1",
    ]  # fmt: skip
    assert step[8:10] == ["--container-image=x", "--export=ALL,AREAL_REGISTER_HOST=addr-of-n2"]
    wrapper = step[10:]
    assert wrapper[1:5] == [
        "-m",
        "areal_cli.launch.step",
        "--register",
        str(tmp_path / "registry" / "server-1.json"),
    ]
    assert wrapper[wrapper.index("--") + 1 :] == server1.argv
    step = runner.command(trainer, trainer.argv)
    assert "--nodelist=n1,n2" in step and "--ntasks=2" in step
    assert "addr-of-n1:" + str(trainer.ports[0]) in step and HEAD_NODE not in " ".join(step)


def test_servers_are_found_through_the_registry(tmp_path: Path) -> None:
    cfg, _, plan = _plan("tiny_cpu.yaml", "launcher.type=slurm")
    plan.run_dir = str(tmp_path)
    port = plan.processes[0].ports[0]
    path = registry.entry_path(tmp_path, "server-0")
    entry = registry.register(path, "server-0", port)
    found = server_addresses(cfg, plan, _runner(tmp_path, ["n1"]))
    assert [s.address for s in found] == [f"http://{entry['host']}:{port}"]
    registry.clear(tmp_path)
    cfg.launcher.startup_timeout_s = 0.3
    with pytest.raises(TimeoutError, match="server-0 did not register"):
        server_addresses(cfg, plan, _runner(tmp_path, ["n1"]))


def test_a_failed_submission_is_an_error_and_the_run_is_recorded_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sbatch that cannot reach the controller (a stand-in script that fails as Slurm's
    does: this is the error path) gives one error line and exit 1, no warning, and ps and
    status show the run as failed with the reason, not as unknown."""
    from tests.conftest import areal_in_process

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        "#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Unable to contact "
        "slurm controller (connect failure)' >&2\nexit 1\n"
    )
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    runs = tmp_path / "runs"
    done = areal_in_process(
        "train", "recipes/tiny_cpu.yaml", "launcher.type=slurm", f"cluster.fileroot={runs}"
    )
    assert done.returncode == 1
    assert done.stderr.startswith("error: sbatch --parsable ") and "warning" not in done.stderr
    assert "Unable to contact slurm controller" in done.stderr
    assert "nothing was submitted" in done.stderr
    listed = areal_in_process("ps", str(runs)).stdout.splitlines()[1].split()
    assert listed[4] == "failed"
    status = areal_in_process("status", str(runs / "tiny-cpu" / "trial0")).stdout
    assert "failed, step 0/24" in status and "error: sbatch --parsable" in status
