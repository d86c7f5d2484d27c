"""The `launcher:` section of the recipe schema: how processes are started (local, Slurm,
Ray), the progress watchdog and the restart limits; the launch layer's own settings,
which areal_cli.config.schema puts under ExperimentConfig."""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli.config.fields import field, sub


@dataclass
class WatchdogConfig:
    """The controller's progress watchdog: a run that stops making progress ends with a named error."""

    timeout_s: float | None = field(
        None,
        "Seconds without a finished trainer step (and without progress of the stuck side) before the run is stopped; null derives it from recent step times.",
        gt=0,
    )
    min_timeout_s: float = field(
        120.0,
        "Floor of the derived limit (it also covers rare slow phases such as checkpoints).",
        gt=0,
    )
    step_time_factor: float = field(
        10.0, "The derived limit is this many times the slowest of the last 10 steps.", gt=1
    )


@dataclass
class RestartsConfig:
    """Relaunching what died instead of stopping the run; past a limit the run stops."""

    trainer: int = field(
        2,
        "Times the trainer (every rank) is relaunched from the newest recover checkpoint after any rank dies, within window_s; 0: a dead rank stops the run.",
        ge=0,
    )
    server: int = field(
        3,
        "Times each inference server is restarted after it dies, within window_s (it loads the current weights before it takes requests again); 0: a dead server stops the run.",
        ge=0,
    )
    window_s: float = field(
        3600.0, "Restarts older than this many seconds no longer count against the limits.", gt=0
    )


@dataclass
class SlurmConfig:
    """The Slurm job that `launcher.type: slurm` submits (nodes and GPUs per node come from cluster)."""

    partition: str = field("", "#SBATCH --partition; empty: the cluster's default partition.")
    account: str = field("", "#SBATCH --account; empty: none.")
    qos: str = field("", "#SBATCH --qos; empty: none.")
    time: str = field(
        "",
        "#SBATCH --time as Slurm writes it (MM, HH:MM:SS or D-HH:MM:SS); empty: the partition's limit.",
    )
    job_name: str = field("", "#SBATCH --job-name; empty: areal-EXPERIMENT-TRIAL.")
    extra_sbatch: list[str] = field(
        factory=list,
        doc="More sbatch options, one per item, each written as an #SBATCH line (e.g. --constraint=a100).",
    )
    preamble: list[str] = field(
        factory=list,
        doc="Shell lines run in the job before the controller starts (module load ..., source .venv/bin/activate, ...).",
    )
    srun_args: list[str] = field(
        factory=list,
        doc="Extra srun options given to every job step (e.g. a container image option of your site).",
    )


@dataclass
class RayConfig:
    """The Ray cluster that `launcher.type: ray` places the processes on."""

    address: str = field(
        "",
        "Address of a running Ray cluster (host:port, or auto); empty starts a local Ray on 127.0.0.1 for this run and stops it at the end.",
    )


@dataclass
class LauncherConfig:
    """How processes are started."""

    type: str = field(
        "local",
        "Launcher: local (subprocesses on this machine), slurm (a batch job whose controller starts the servers and the trainer as job steps) or ray (Ray actors in one placement group).",
        choices=("local", "slurm", "ray"),
    )
    trainer_port: int = field(
        0,
        "Rendezvous port of the torchrun trainer (c10d); 0: one picked at launch (on the local launcher torchrun binds a free port itself, so two runs never meet).",
        ge=0,
        le=65535,
    )
    inference_base_port: int = field(
        0,
        "Port of the first inference server; server i listens on base + i. 0: each server gets a free port picked at launch, so runs started together never share one.",
        ge=0,
        le=65535,
    )
    startup_timeout_s: float = field(
        300.0, "Overall time allowed for every server to become healthy before the run fails.", gt=0
    )
    stop_timeout_s: float = field(
        30.0,
        "After Ctrl-C, `areal stop` or SIGTERM: how long the controller may take to wind its loop down before it kills every process of the run at once and names where it was stuck (a second Ctrl-C does that at once). The run resumes with --resume either way.",
        gt=0,
    )
    env: dict[str, str] = field(
        factory=dict, doc="Extra environment variables given to every child process."
    )
    watchdog: WatchdogConfig = sub(WatchdogConfig)
    restarts: RestartsConfig = sub(RestartsConfig)
    slurm: SlurmConfig = sub(SlurmConfig)
    ray: RayConfig = sub(RayConfig)
