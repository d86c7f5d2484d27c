"""One checkpoint argument for `areal eval --checkpoint`, `areal serve` and
`areal convert-checkpoint SRC`: each accepts the same kinds, told apart here.

  an HF folder        config.json and *.safetensors: any model folder, RUN/weights/vN,
                      RUN/checkpoints/step-N, RUN/model
  a run directory     config.yaml and plan.json: its newest finished weights/vN
  a DCP checkpoint    RUN/recover/step-N (a folder with dcp/.metadata, or .metadata)
  a LoRA adapter      PEFT's adapter_config.json and adapter_model.safetensors: a LoRA
                      run's weights/vN and checkpoints/step-N (its base model is the one
                      adapter_config.json names)

Anything else is a `CheckpointError` whose one line lists these kinds. What each command
does with a DCP checkpoint is its own: eval and convert-checkpoint convert it, serve asks
for the conversion (it serves HF folders).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from areal_cli.rundir import handoff
from areal_cli.rundir.layout import is_adapter_folder
from areal_cli.rundir.paths import VERSION_PREFIX, RunDir

KINDS = (
    "an HF folder (config.json and *.safetensors), a LoRA adapter folder, a run directory (its newest weights/vN), "
    "RUN/weights/vN, RUN/checkpoints/step-N or RUN/recover/step-N"
)


class CheckpointError(ValueError):
    """A path that is no checkpoint of any accepted kind (bad input: exit code 2)."""


@dataclass(frozen=True)
class Located:
    """What a checkpoint argument names: an HF folder or a DCP checkpoint, and the run
    directory it belongs to (None for a folder outside any run)."""

    kind: str  # "hf", "dcp" or "lora"
    path: Path  # the HF folder, or the DCP checkpoint as named (RUN/recover/step-N)
    run_dir: Path | None


def is_run_dir(path: Path) -> bool:
    return RunDir(path).config.is_file() and RunDir(path).plan.is_file()


def run_dir_containing(path: Path) -> Path | None:
    """The run directory that `path` lies in, if any: RUN/weights/vN, RUN/checkpoints/
    step-N and RUN/recover/step-N belong to RUN."""
    for parent in list(path.parents)[:3]:
        if is_run_dir(parent):
            return parent
    return None


def locate(path: Path) -> Located:
    """Tell which kind of checkpoint `path` is (see the module docstring), or raise
    CheckpointError saying what it is not and what would do."""
    path = path.expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give {KINDS}")
    path = path.resolve()
    if is_adapter_folder(path):
        return Located("lora", path, run_dir_containing(path))
    if (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            raise CheckpointError(f"{path} has config.json but no *.safetensors; give {KINDS}")
        return Located("hf", path, run_dir_containing(path))
    if (path / ".metadata").is_file() or (path / "dcp" / ".metadata").is_file():
        return Located("dcp", path, run_dir_containing(path))
    if is_run_dir(path):
        entry = handoff.latest(RunDir(path).weights, VERSION_PREFIX)
        if entry is None:
            raise CheckpointError(
                f"run directory {path} has no finished weights/vN yet; give one of its "
                "checkpoints (RUN/checkpoints/step-N, RUN/recover/step-N) instead"
            )
        return Located("lora" if is_adapter_folder(entry.path) else "hf", entry.path, path)
    raise CheckpointError(f"{path} is not a checkpoint; give {KINDS}")
