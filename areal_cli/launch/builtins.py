"""Builtin models (`model.path: builtin:NAME`) as the launch layer makes them.

`cached(model, seed, say)` returns the cache folder of a builtin model, built there on
first use with its progress shown (a rich bar on a terminal, a line every few seconds
otherwise), and `materialize` links it into a run's RUN/model. areal_cli.models.builtin
keeps the cache and its lock; this module brings the one builder that needs the product
itself: `builtin:tiny-arith`, `builtin:tiny` after supervised fine-tuning on addition
(see areal_cli.models.demo_model), is made by running `areal train` on the packaged SFT
recipe as a child process (`build_tiny_arith`). That run is the launch layer's to start:
models/ sits below the CLI and never runs it.

The build is deterministic for a given seed on a given number of cores (the recipe gives
the trainer 2), and its folder is written atomically (a temporary folder in the same
parent, then a rename). It holds the model, the tokenizer (with its chat template), the
SFT run's metrics (sft_metrics.jsonl) and demo_model.json recording how it was made and
its accuracy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from areal_cli.models import builtin
from areal_cli.models.demo_model import INFO_FILE, SFT_RECIPE, evaluate, write_arith_data
from areal_cli.rundir import handoff
from areal_cli.rundir.paths import STEP_PREFIX, RunDir

Progress = Callable[[int, int], None]  # (steps done, steps in all)


def cached(model: str, seed: int, say: Callable[[str], None] = lambda line: None) -> Path:
    """The cache folder of builtin model `model` (builtin:NAME or NAME) for `seed`, built
    on first use: `say` gets a line when a build starts, and a long one shows its steps."""
    from areal_cli.metrics.display import BuildProgress

    name = model.removeprefix("builtin:")
    progress = BuildProgress(f"building builtin:{name}")
    try:
        return builtin.build_cached(name, seed, build_sft, progress, say)
    finally:
        progress.close()


def materialize(
    model: str, seed: int, dest: Path, say: Callable[[str], None] = lambda line: None
) -> Path:
    """Builtin model `model` for `seed` at `dest` (linked from the cache, built first when
    needed)."""
    name = model.removeprefix("builtin:")
    cached(name, seed, say)
    return builtin.materialize(name, seed, dest, build_sft)


def build_sft(name: str, out_dir: Path, seed: int, progress: Progress | None = None) -> dict:
    """Make builtin model `name` (one of builtin.SFT_BUILT) by its SFT run."""
    builders = {"tiny-arith": build_tiny_arith, "tiny-tool": build_tiny_tool}
    return builders[name](out_dir, seed, progress)


def build_tiny_tool(out_dir: Path, seed: int, progress: Progress | None = None) -> dict:
    """builtin:tiny-tool for `seed` into `out_dir` (areal_cli.models.tool_model); returns
    what its info file holds."""
    from areal_cli.models.tool_model import SFT_RECIPE as TOOL_RECIPE
    from areal_cli.models.tool_model import TOOL_SHARE, write_tool_data

    def describe(checkpoint: Path, metrics: list[dict]) -> dict:
        return {"base": "builtin:tiny", "tool_share": TOOL_SHARE}

    return _build_by_sft(out_dir, TOOL_RECIPE, write_tool_data, seed, (), progress, describe)


def build_tiny_arith(out_dir: Path, seed: int, progress: Progress | None = None) -> dict:
    """builtin:tiny-arith for `seed` into `out_dir`, graded by the demo's reward
    (builtin:numeric); returns what demo_model.json holds."""
    from areal_cli.rollout.rewards import numeric

    return build_arith_demo_model(out_dir, numeric, seed=seed, progress=progress)


def build_arith_demo_model(
    out_dir: Path,
    score: Callable[[str, str], float],
    seed: int = 1,
    overrides: tuple[str, ...] = (),
    eval_samples: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Build tiny-arith into `out_dir` atomically by running the SFT recipe (see the
    module docstring; `overrides` are extra `key=value`s for it), graded by `score`;
    returns what demo_model.json holds."""

    def describe(checkpoint: Path, metrics: list[dict]) -> dict:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        return {
            "base": "builtin:tiny",
            **evaluate(model, tokenizer, score, eval_samples, 6, seed + 1),
        }

    return _build_by_sft(out_dir, SFT_RECIPE, write_arith_data, seed, overrides, progress, describe)


def _build_by_sft(
    out_dir: Path,
    sft_recipe: Path,
    write_data: Callable[[Path], object],
    seed: int,
    overrides: tuple[str, ...],
    progress: Progress | None,
    describe: Callable[[Path, list[dict]], dict],
) -> dict:
    """Run `sft_recipe` beside the data `write_data` writes, and put its final checkpoint
    at `out_dir` atomically with an info file: how it was made, its losses, and what
    `describe(checkpoint, metrics)` adds."""
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        work = tmp / "sft"
        work.mkdir()
        write_data(work)
        recipe = Path(shutil.copy(sft_recipe, work / sft_recipe.name))
        checkpoint, metrics = _run_sft(recipe, tmp / "runs", seed, overrides, progress)
        held_out = [m["eval_loss"] for m in metrics if "eval_loss" in m]
        info = {
            "seed": seed,
            "made_by": f"areal train {sft_recipe.name} " + " ".join(overrides),
            "steps": len(metrics),
            "first_loss": metrics[0]["loss"],
            "final_loss": metrics[-1]["loss"],
            "held_out_loss": held_out,
            **describe(checkpoint, metrics),
        }
        # a plain HF folder: the run's entry manifest describes a checkpoint, not this model
        (checkpoint / handoff.MANIFEST).unlink()
        shutil.copy(metrics_path(checkpoint), checkpoint / "sft_metrics.jsonl")
        (checkpoint / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if out_dir.exists():  # replacing: move the old folder aside, then swap the new one in
            os.rename(out_dir, tmp / "old")
        os.rename(checkpoint, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def metrics_path(checkpoint: Path) -> Path:
    """RUN/metrics.jsonl of the run that wrote RUN/checkpoints/step-N."""
    return RunDir(checkpoint.parents[1]).metrics


def _run_sft(
    recipe: Path,
    fileroot: Path,
    seed: int,
    overrides: tuple[str, ...],
    progress: Callable[[int, int], None] | None = None,
):
    """Run `areal train RECIPE` as a child process, telling `progress` its steps (the
    lines of its metrics.jsonl) twice a second; returns its final checkpoint folder and
    its metrics. A failure raises with the tail of the run's output."""
    import yaml

    from areal_cli.rundir.process import die_with_parent

    settings = yaml.safe_load(recipe.read_text())
    total = int(settings["total_train_steps"])
    for item in overrides:
        if item.startswith("total_train_steps="):
            total = int(item.split("=", 1)[1])
    argv = [
        sys.executable,
        "-m",
        "areal_cli.cli",
        "train",
        str(recipe),
        f"cluster.fileroot={fileroot}",
        f"seed={seed}",
        f"model.seed={seed}",
        "logging.display=plain",
        *overrides,
    ]
    run_dir = fileroot / settings["experiment_name"] / "trial0"
    output = fileroot.parent / "sft-output.log"
    with open(output, "wb") as log:
        child = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )  # fmt: skip
        try:
            while child.poll() is None:
                if progress is not None:
                    progress(_lines(RunDir(run_dir).metrics), total)
                time.sleep(0.5)
        finally:
            if child.poll() is None:  # interrupted: the run goes with its parent
                child.kill()
                child.wait()
    found = [e.path for e in handoff.list_entries(RunDir(run_dir).checkpoints, STEP_PREFIX)]
    if child.returncode != 0 or not found:
        tail = "\n".join(output.read_text(errors="replace").strip().splitlines()[-15:])
        raise RuntimeError(
            f"building a builtin model failed: `areal train {recipe.name}` exited with "
            f"{child.returncode}; the last lines of its output:\n{tail}"
        )
    if progress is not None:
        progress(total, total)
    lines = metrics_path(found[-1]).read_text().splitlines()
    return found[-1], [json.loads(line) for line in lines if line]


def _lines(path: Path) -> int:
    """How many complete lines a file holds (0 when it is missing)."""
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0
