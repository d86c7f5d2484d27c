"""Every name inside a run directory, in one place: `RunDir(path).weights`, not
`path / "weights"`. No module outside areal_cli.rundir spells these names
(tests/unit/test_layers.py says so).

    FILEROOT/EXPERIMENT/TRIAL/
      config.yaml  plan.json  run.json  metrics.jsonl  reward_curve.png | loss_curve.png
      logs/        controller.log, server-N.log, trainer.log, trainer-metrics.jsonl, torchrun/
      heartbeat/   trainer-<rank>.json
      registry/    server-N.json (cluster launchers)
      rollouts/step-K  weights/vK  checkpoints/step-K (and critic/step-K)  recover/step-K
      eval/        areal eval outputs
      model/ model-rm/ model-critic/   built or derived models
      tensorboard/ slurm/job.sbatch

Steps count from 1, in every name and figure: step K is the K-th update of the model.
It trains on rollouts/step-K, publishes weights/vK (v0 is the initial model), is the line
`"step": K` of metrics.jsonl, the console's "step K/N" and `areal status`'s K/N (K steps
done), and when due it writes recover/step-K and checkpoints/step-K: the state after K
steps. A resume from recover/step-K goes on with step K+1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STEP_PREFIX = "step-"  # rollouts/, recover/, checkpoints/: step-K
VERSION_PREFIX = "v"  # weights/: vK

# The folders every run has (created by layout.prepare_run_dir)
SUBDIRS = ("logs", "heartbeat", "registry", "rollouts", "weights", "checkpoints", "recover", "eval")
CONFIG_FILE = "config.yaml"  # the resolved config, exactly as run: marks a run directory
PLAN_FILE = "plan.json"


def step_name(step: int) -> str:
    """The entry of step `step` (from 1) under rollouts/, recover/ or checkpoints/."""
    return f"{STEP_PREFIX}{step}"


def version_name(version: int) -> str:
    """The entry of weight version `version` under weights/ (the weights after that many steps)."""
    return f"{VERSION_PREFIX}{version}"


@dataclass(frozen=True)
class RunDir:
    """Named paths of one run directory (nothing is created or read here)."""

    root: Path

    # folders
    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def heartbeat(self) -> Path:
        return self.root / "heartbeat"

    @property
    def registry(self) -> Path:
        return self.root / "registry"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def recover(self) -> Path:
        return self.root / "recover"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def model(self) -> Path:
        """The builtin model of a builtin:NAME run (linked from the cache)."""
        return self.root / "model"

    @property
    def teacher(self) -> Path:
        """The builtin distillation teacher of teacher.path: builtin:NAME (linked)."""
        return self.root / "teacher"

    @property
    def scalar_model(self) -> Path:
        """The model a reward-model run trains: model.path's body with a scalar head."""
        return self.root / "model-rm"

    @property
    def critic_model(self) -> Path:
        """The PPO critic's starting model, likewise."""
        return self.root / "model-critic"

    # files
    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def plan(self) -> Path:
        return self.root / PLAN_FILE

    @property
    def proxy(self) -> Path:
        """The agent proxy's address for outside clients (rollout.mode online)."""
        return self.root / "proxy.json"

    @property
    def online(self) -> Path:
        """Where every online session went, written when the run ends (rollout.mode online)."""
        return self.root / "online.json"

    @property
    def controller_lock(self) -> Path:
        """The controller's exclusive hold on the run directory (rundir.layout.claim_run_dir)."""
        return self.root / ".controller.lock"

    @property
    def record(self) -> Path:
        """run.json: launcher, job id, host, pids and state (areal ps / status / stop)."""
        return self.root / "run.json"

    @property
    def metrics(self) -> Path:
        """metrics.jsonl: one line per step, written by the controller."""
        return self.root / "metrics.jsonl"

    @property
    def trainer_metrics(self) -> Path:
        """The trainer's own line per step, which the controller joins into metrics.jsonl."""
        return self.logs / "trainer-metrics.jsonl"

    @property
    def reward_curve(self) -> Path:
        return self.root / "reward_curve.png"

    @property
    def loss_curve(self) -> Path:
        return self.root / "loss_curve.png"

    @property
    def torchrun_logs(self) -> Path:
        return self.logs / "torchrun"

    @property
    def sbatch(self) -> Path:
        return self.root / "slurm" / "job.sbatch"

    def log(self, name: str) -> Path:
        """The log of process NAME (controller, trainer, server-0, ray-head, ...)."""
        return self.logs / f"{name}.log"

    # entries
    def rollout(self, step: int) -> Path:
        return self.rollouts / step_name(step)

    def weights_of(self, version: int) -> Path:
        return self.weights / version_name(version)

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    @property
    def critic_checkpoints(self) -> Path:
        return self.checkpoints / "critic"

    def recover_entry(self, step: int) -> Path:
        return self.recover / step_name(step)
