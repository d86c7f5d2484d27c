"""The Slurm launcher (`launcher.type: slurm`): a batch job whose controller starts the
servers and the trainer as job steps.

Submit, where `areal train R launcher.type=slurm` runs (a login node): the recipe and the
dataset are checked as for a local run, RUN/config.yaml and RUN/plan.json are written,
then RUN/slurm/job.sbatch (`render_sbatch`) is written and handed to `sbatch`. RUN/run.json
records the job id (state pending) and the command prints how to follow it.

In the allocation, the batch script runs the same `areal train R ...` with the hidden
`--in-allocation` flag on the job's first node. That controller is the run's controller
as on a laptop (rollout loop, watchdog, restarts); only its runner differs: `SlurmRunner`
starts each process of the plan as a job step on the nodes the plan gives it:

  srun --overlap --nodes=K --ntasks=K --ntasks-per-node=1 --nodelist=... --job-name=NAME
       --kill-on-bad-exit=1 [launcher.slurm.srun_args] COMMAND

--overlap lets the steps share the job's CPUs and GPUs (without it a second step waits
for the first to end); the plan's CUDA_VISIBLE_DEVICES and thread counts split them. A
server's step runs areal_cli.launch.step first, which writes RUN/registry/NAME.json (the
node's NodeAddr, port, pid, step id) and execs the server: the controller reaches servers through the
registry only. The trainer's step runs torchrun on each of its nodes with
`--nnodes K --rdzv-backend c10d --rdzv-endpoint FIRST_NODE:PORT`.

Ends: `scancel JOB` (or `areal stop RUN`, which signals the controller first) reaches
the controller as SIGTERM, which stops every step as Ctrl-C does locally. `scancel` of
one step does the same (ProcessCancelled: it is not restarted as a crash would be). When the
controller dies (kill -9), the batch step ends, so the job ends and Slurm ends every step
with it. `--resume` submits a new job that continues the run. SIGTERM also comes 120 s
before the job's time limit (`--signal=B:TERM@120`), so a run that hits its limit stops
cleanly and can be resumed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from areal_cli.launch.local import ChildFailed, LocalRunner, ProcessCancelled
from areal_cli.launch.plan import HEAD_NODE, LaunchPlan, ProcessSpec
from areal_cli.launch.step import server_command
from areal_cli.rundir.paths import RunDir
from areal_cli.rundir.registry import HOST_ENV

SECRET_ENV = "AREAL_INFERENCE_API_KEY"  # the API key travels to the job in the environment
TIME_LIMIT_SIGNAL = "B:TERM@120"


class SlurmError(RuntimeError):
    """A Slurm command failed; the message quotes what it printed."""


def run_slurm(argv: list[str], timeout_s: float = 60.0, env: dict | None = None) -> str:
    """Run a Slurm command and return its stdout; SlurmError when it fails."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"{argv[0]} not found on PATH: run this where Slurm's commands are")
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{shlex.join(argv)} did not answer within {timeout_s:g}s") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise SlurmError(f"{shlex.join(argv)} failed: {said}")
    return done.stdout


# ------------------------------------------------------------------ the batch script


def job_command(recipe: Path, overrides: list[str], resume: bool) -> list[str]:
    """The controller's command line inside the job. The servers listen on every
    interface there, so they always get an API key: `launch.submit.submit_run` hands the job the
    recipe's key, or a random one, in SECRET_ENV, and this line only refers to it (no
    file holds the key)."""
    kept = [o for o in overrides if not o.startswith("inference.api_key=")]
    argv = [sys.executable, "-m", "areal_cli.cli", "train", str(recipe.resolve()), *kept]
    argv.append(f"inference.api_key=${SECRET_ENV}")
    return argv + ["--in-allocation"] + (["--resume"] if resume else [])


def render_sbatch(cfg: Any, plan: LaunchPlan, command: list[str], cwd: str) -> str:
    """The batch script: #SBATCH lines from cluster and launcher.slurm, the preamble, then
    the controller (exec, so scancel's SIGTERM reaches it)."""
    slurm, cluster = cfg.launcher.slurm, cfg.cluster
    run_dir = Path(plan.run_dir)
    options = [
        f"--job-name={slurm.job_name or f'areal-{cfg.experiment_name}-{cfg.trial_name}'}",
        f"--nodes={cluster.n_nodes}",
        "--ntasks-per-node=1",
    ]
    if cluster.n_cpus:
        options.append(f"--cpus-per-task={cluster.n_cpus}")
    if cluster.n_gpus_per_node:
        options.append(f"--gpus-per-node={cluster.n_gpus_per_node}")
    for key in ("partition", "account", "qos", "time"):
        if getattr(slurm, key):
            options.append(f"--{key}={getattr(slurm, key)}")
    options += [
        f"--output={RunDir(run_dir).logs / 'slurm-%j.out'}",
        "--open-mode=append",
        f"--chdir={cwd}",
        f"--signal={TIME_LIMIT_SIGNAL}",
        *slurm.extra_sbatch,
    ]
    lines = [
        "#!/bin/bash",
        f"# Written by areal train (launcher.type: slurm) for {run_dir}.",
        "# The controller below starts the servers and the trainer as job steps (srun).",
        *(f"#SBATCH {shlex.quote(o) if ' ' in o else o}" for o in options),
        "set -e",
        *slurm.preamble,
        "export PYTHONUNBUFFERED=1",
        "exec " + " ".join(_shell_word(a) for a in command),
        "",
    ]
    return "\n".join(lines)


def _shell_word(arg: str) -> str:
    """Quote `arg` for bash, leaving a $SECRET_ENV reference to expand."""
    ref = f"${SECRET_ENV}"
    if arg.endswith("=" + ref):
        return shlex.quote(arg[: -len(ref)]) + f'"{ref}"'
    return shlex.quote(arg)


# ------------------------------------------------------------------ the job's state


def job_state(job_id: str) -> str | None:
    """The job's Slurm state (PENDING, RUNNING, ...), None when Slurm no longer lists it;
    SlurmError when squeue cannot tell."""
    try:
        out = run_slurm(["squeue", "-h", "-j", str(job_id), "-o", "%T"], timeout_s=20)
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return None
        raise
    states = out.split()
    return states[0] if states else None


def cancel(job_id: str, *, controller_only: bool = False) -> None:
    """scancel the job; with controller_only, SIGTERM to the batch step's controller
    only, which then stops its steps as Ctrl-C does."""
    argv = ["scancel"] + (["--batch", "--signal=TERM"] if controller_only else []) + [job_id]
    run_slurm(argv, timeout_s=30)


def stop_job(job_id: str, timeout_s: float) -> str:
    """`areal stop` of a Slurm run: SIGTERM to the controller, then wait for the job to
    end (a pending job is cancelled outright); scancel after `timeout_s`."""
    state = job_state(job_id)
    if state is None:
        return f"job {job_id} has already ended"
    if state != "RUNNING":
        cancel(job_id)
        return f"cancelled job {job_id} ({state.lower()})"
    cancel(job_id, controller_only=True)
    deadline = time.monotonic() + timeout_s
    while job_state(job_id) is not None:
        if time.monotonic() > deadline:
            cancel(job_id)
            return f"job {job_id} did not end {timeout_s:g}s after SIGTERM; cancelled it"
        time.sleep(0.5)
    return f"stopped (job {job_id} and every step of it)"


# ------------------------------------------------------------------ in the allocation


class SlurmRunner(LocalRunner):
    """LocalRunner whose children are job steps (the srun clients run here; the steps run
    on the plan's nodes). Slurm places the processes, so no CPU affinity is set."""

    pin_cpus = False

    def __init__(self, plan: LaunchPlan, srun_args: list[str]) -> None:
        super().__init__()
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
        if not self.job_id or not nodelist:
            raise SlurmError("not inside a Slurm job (no SLURM_JOB_ID / SLURM_JOB_NODELIST)")
        self.run_dir = Path(plan.run_dir)
        self.nodes = run_slurm(["scontrol", "show", "hostnames", nodelist]).split()
        if len(self.nodes) < plan.n_nodes:
            raise SlurmError(f"the job has {len(self.nodes)} nodes, the plan needs {plan.n_nodes}")
        self.srun_args = list(srun_args)
        self.addresses: dict[str, str] = {}  # node -> NodeAddr, asked once
        self.log_start: dict[int, int] = {}  # id(child) -> its log's size when it started

    def start(self, spec: ProcessSpec, argv: list[str] | None = None) -> Any:
        try:
            size = Path(spec.log).stat().st_size
        except OSError:
            size = 0
        child = super().start(spec, argv)
        self.log_start[id(child)] = size
        return child

    def check(self, allow_exit: set[str] = frozenset()) -> None:
        """As LocalRunner.check; a step that Slurm says was cancelled (scancel) raises
        ProcessCancelled instead of ChildFailed, so nothing restarts it."""
        try:
            super().check(allow_exit)
        except ChildFailed as exc:
            if self._cancelled(exc.child):
                raise ProcessCancelled(f"{exc.child.spec.name}'s job step was cancelled") from None
            raise

    def _cancelled(self, child: Any) -> bool:
        try:
            with open(child.spec.log, "rb") as log:
                log.seek(self.log_start.get(id(child), 0))
                said = log.read().decode(errors="replace")
        except OSError:
            return False
        return " CANCELLED AT " in said  # slurmstepd's "*** STEP J.S ON NODE CANCELLED AT"

    def node_address(self, node: str) -> str:
        """The address Slurm knows the node by (NodeAddr): the trainer's rendezvous host
        and the servers' registered host."""
        if node not in self.addresses:
            fields = run_slurm(["scontrol", "show", "node", "-o", node]).split()
            found = dict(f.split("=", 1) for f in fields if "=" in f)
            self.addresses[node] = found.get("NodeAddr") or node
        return self.addresses[node]

    def command(self, spec: ProcessSpec, argv: list[str]) -> list[str]:
        nodes = [self.nodes[i] for i in spec.nodes]
        step = [
            "srun",
            "--overlap",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}",
            f"--job-name={spec.name}",
            "--kill-on-bad-exit=1",
            *self.srun_args,
        ]
        if spec.role.startswith("inference"):
            # the address the controller will reach it at: the node's, as Slurm knows it
            step.append(f"--export=ALL,{HOST_ENV}={self.node_address(nodes[0])}")
            return step + server_command(self.run_dir, spec.name, spec.ports[0], argv)
        head = self.node_address(nodes[0])
        return step + [a.replace(HEAD_NODE, head) for a in argv]

    def stop(self, child: Any, grace_s: float = 10.0) -> None:
        super().stop(child, grace_s)
        self._cancel_steps({child.spec.name})

    def stop_all(self, grace_s: float = 10.0) -> None:
        super().stop_all(grace_s)
        self._cancel_steps({c.spec.name for c in self.children})

    def _cancel_steps(self, names: set[str]) -> None:
        """scancel what is left of these steps (an srun client that was killed leaves its
        step running until the job ends)."""
        try:
            out = run_slurm(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"], 20)
            steps = [line.split() for line in out.splitlines() if len(line.split()) == 2]
            for step_id, name in steps:
                if name in names:
                    run_slurm(["scancel", step_id], timeout_s=20)
        except SlurmError:
            pass  # the job ends with the controller anyway, and Slurm ends its steps then
