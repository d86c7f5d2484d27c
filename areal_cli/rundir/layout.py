"""How a run directory starts and resumes (its names are in areal_cli.rundir.paths).

`prepare_run_dir` creates the tree and writes config.yaml and plan.json (each through a
temp name and a rename); `trim_after` forgets what a resumed run will redo. Both only
touch this run's own directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from areal_cli.config.schema import ExperimentConfig
from areal_cli.rundir import handoff
from areal_cli.rundir.paths import STEP_PREFIX, VERSION_PREFIX, RunDir
from areal_cli.rundir.weight_group import GROUP_FILE

# Files of a model folder that travel with its weights (exports, conversions); the weights
# themselves and any index or manifest are written anew.
_MODEL_FILE_SUFFIXES = (".json", ".jinja", ".txt", ".model")
_NOT_MODEL_FILES = ("model.safetensors.index.json", handoff.MANIFEST)


# A LoRA adapter folder, in PEFT's layout (areal_cli.models.lora writes and reads it).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_folder(folder: str | Path) -> bool:
    """Whether `folder` holds a LoRA adapter (PEFT's adapter_config.json), not a model."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def adapter_base_model(folder: str | Path) -> Path:
    """The base model folder a LoRA adapter folder names (its adapter_config.json's
    base_model_name_or_path); raises ValueError when that is unreadable or not a model
    folder (config.json) on this machine. Callers add how to go on."""
    config = Path(folder) / ADAPTER_CONFIG
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"cannot read {config}: {exc}") from exc
    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(
            f"{config}: base_model_name_or_path {base!r} is not a model folder on this machine"
        )
    return Path(base)


def adapter_problem(folder: str | Path) -> str:
    """Why the adapter folder must not be served ('' when it may): no adapter weights
    file (a server may read a missing path as a Hub id), or a handoff entry (a run's
    weights/vN, checkpoints/step-N) whose files fail their manifest's sizes or CRC-32s.
    An adapter is a few MB, so every load checks it whole; a folder without a manifest
    (one made by PEFT) is taken as it is."""
    if not (Path(folder) / ADAPTER_WEIGHTS).is_file():
        return f"refused adapter: {folder} holds no {ADAPTER_WEIGHTS}"
    if not (Path(folder) / handoff.MANIFEST).is_file():
        return ""
    try:
        handoff.read_entry(Path(folder), verify_crc=True)
    except handoff.IncompleteEntry as exc:
        return f"refused adapter: {exc}"
    return ""


def run_dir_of(cfg: ExperimentConfig) -> Path:
    """FILEROOT/EXPERIMENT/TRIAL, absolute."""
    return (
        Path(cfg.cluster.fileroot).expanduser() / cfg.experiment_name / cfg.trial_name
    ).absolute()


def initial_model_path(cfg: ExperimentConfig, run_dir: Path) -> str:
    """Where servers and trainer load the initial weights from (builtins are built in RUN/model)."""
    if cfg.model.path.startswith("builtin:"):
        return str(RunDir(run_dir).model)
    return cfg.model.path


def teacher_model_path(cfg: ExperimentConfig, run_dir: Path) -> str:
    """Where the trainer loads the distillation teacher from (a builtin is built in
    RUN/teacher); empty: no teacher."""
    if cfg.teacher.path.startswith("builtin:"):
        return str(RunDir(run_dir).teacher)
    return cfg.teacher.path


def model_files_to_copy(model_dir: Path) -> list[Path]:
    """Config, generation config and tokenizer files to ship beside exported weights."""
    return [
        p
        for p in sorted(model_dir.iterdir())
        if p.suffix in _MODEL_FILE_SUFFIXES and p.name not in _NOT_MODEL_FILES
    ]


class RunInUse(FileExistsError):
    """Another live controller holds the run directory."""


class RunClaim:
    """One controller's hold on its run directory: an exclusive lock on
    RUN/.controller.lock, held until `close` or the end of the process (the kernel drops
    it when the process dies, kill -9 too, so no stale claim is left). Two `areal train`
    that name the same run directory at once (two demos started in the same second) never
    share it: the second one is refused before it writes anything there."""

    def __init__(self, run_dir: Path) -> None:
        import fcntl

        path = RunDir(run_dir).controller_lock
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a+")  # noqa: SIM115 (held open: the lock lives with it)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "?"
            self._file.close()
            raise RunInUse(
                f"{run_dir} is in use by another areal train (pid {holder}); wait for it, "
                f"stop it with `areal stop {run_dir}`, or set another trial_name"
            ) from None
        self._file.truncate(0)
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()  # closing drops the lock


def prepare_run_dir(
    run_dir: Path, dirs: list[str], config_yaml: str, plan: dict[str, Any], resume: bool
) -> int:
    """Create the run tree and write config.yaml and plan.json; returns the first step to
    run (1, or the step after the newest recover entry).

    A directory that already holds published weights is refused unless `resume` is set."""
    paths = RunDir(run_dir)
    started = paths.weights.is_dir() and any(paths.weights.iterdir())
    if started and not resume:
        raise FileExistsError(
            f"{run_dir} already holds a run; add --resume to continue it, or set another trial_name"
        )
    for directory in dirs:
        Path(directory).mkdir(parents=True, exist_ok=True)
    handoff.write_json_atomic(paths.plan, plan)
    handoff.write_text_atomic(paths.config, config_yaml)
    if not resume:
        return 1
    entry = handoff.latest(paths.recover, STEP_PREFIX)
    return entry.version + 1 if entry else 1


def trim_after(run_dir: Path, last_step: int) -> None:
    """Forget rollouts, weights and metrics of steps after `last_step` (they will be
    redone), and the weight-update group of the trainer that stopped (method distributed:
    the next trainer forms its own, which the controller must not mistake for the old)."""
    paths = RunDir(run_dir)
    (paths.weights / GROUP_FILE).unlink(missing_ok=True)
    for entry in handoff.list_entries(paths.rollouts, STEP_PREFIX):
        if entry.version > last_step:
            handoff.remove_entry(entry.path)
    for entry in handoff.list_entries(paths.weights, VERSION_PREFIX):
        if entry.version > last_step:  # trained after the checkpoint: will be redone
            handoff.remove_entry(entry.path)
    for path in (paths.metrics, paths.trainer_metrics):
        if path.exists():
            keep = [
                line
                for line in path.read_text().splitlines()
                if line and json.loads(line)["step"] <= last_step
            ]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, path)
