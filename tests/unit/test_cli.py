"""The user-facing surface: help, lazy imports, validate, dry runs, the reference."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_areal, snapshot

RECIPES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "recipes").glob("*.yaml"))


def test_help_lists_commands() -> None:
    result = run_areal("--help")
    assert result.returncode == 0
    for command in ("validate", "train"):
        assert command in result.stdout


def test_train_help_is_frozen() -> None:
    result = run_areal("train", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--dry-run", "--json", "RECIPE.yaml", "KEY=VALUE"):
        assert option in result.stdout


@pytest.mark.parametrize(
    "command", ["serve", "train", "eval", "convert-checkpoint", "import-recipe"]
)
def test_help_off_a_terminal_keeps_every_word_whole(command: str) -> None:
    """Off a terminal the help wraps instead of cutting words (rich's boxes cut
    `/update_weights_from_disk` to `/update_weights_from_di…` at 80 columns)."""
    result = run_areal(command, "--help", env={"COLUMNS": "80"})  # as a pipe is to rich
    assert result.returncode == 0 and "\u2026" not in result.stdout, result.stdout
    if command == "serve":
        assert "/update_weights_from_disk" in result.stdout


def test_convert_checkpoint_usage_names_its_arguments() -> None:
    result = run_areal("convert-checkpoint", "--help")
    usage = next(line for line in result.stdout.splitlines() if "Usage:" in line)
    # Typer marks required arguments with braces, as in `{RECIPE.yaml}` of `train`.
    assert "{SRC} {DST}" in usage, usage


def test_cli_import_does_not_pull_heavy_modules() -> None:
    code = (
        "import sys\n"
        "from areal_cli.cli import app\n"
        "try:\n    app(['--help'], prog_name='areal')\nexcept SystemExit:\n    pass\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'sglang', 'safetensors', 'aiohttp'})\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    assert "HEAVY []" in out


@pytest.mark.parametrize("recipe", RECIPES)
def test_validate_passes_on_every_recipe(recipe: str) -> None:
    result = run_areal("validate", recipe)
    assert result.returncode == 0, result.stderr
    assert "experiment_name:" in result.stdout


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_prints_plan_and_writes_nothing(recipe: str, tmp_path: Path) -> None:
    before = snapshot(REPO)
    result = run_areal("train", recipe, "--dry-run", f"cluster.fileroot={tmp_path}/runs")
    assert result.returncode == 0, result.stderr
    assert "torchrun --nnodes 1 --nproc-per-node" in result.stdout
    assert "--standalone" in result.stdout  # a free rendezvous port (launcher.trainer_port 0)
    servers = ("sglang.launch_server" in result.stdout) or (
        "areal_cli.inference.server" in result.stdout
    )
    supervised = (
        re.search(r"algorithm (sft|rm|dpo): no inference server", result.stdout) is not None
    )
    assert servers != supervised  # an RL recipe plans servers; an SFT or RM recipe plans none
    assert not (tmp_path / "runs").exists()
    assert snapshot(REPO) == before


def test_dry_run_json_is_machine_readable(tmp_path: Path) -> None:
    result = run_areal(
        "train", "recipes/gsm8k_grpo.yaml", "--dry-run", "--json", f"cluster.fileroot={tmp_path}"
    )
    plan = json.loads(result.stdout)
    assert [p["name"] for p in plan["processes"]] == [
        "server-0",
        "server-1",
        "server-2",
        "server-3",
        "trainer",
    ]
    assert plan["run_dir"] == f"{tmp_path}/gsm8k-grpo/trial0"
    assert {"logs", "rollouts", "weights", "recover"} <= {Path(d).name for d in plan["dirs"]}


def test_reference_doc_is_in_sync() -> None:
    from areal_cli.config.reference import HEADER, render

    expected = HEADER + "\n" + render()
    actual = (REPO / "docs" / "config-reference.md").read_text()
    assert actual == expected, (
        "run: python -m areal_cli.config.reference > docs/config-reference.md"
    )


def test_a_fixed_port_that_is_taken_stops_the_run_before_anything_starts(tmp_path: Path) -> None:
    import socket

    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        port = stranger.getsockname()[1]
        result = run_areal(
            "train", "recipes/tiny_cpu.yaml", f"cluster.fileroot={tmp_path}/runs",
            f"launcher.inference_base_port={port}",
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert (
        f"launcher.inference_base_port: port {port} (server-0) is already in use" in result.stderr
    )
    assert not (tmp_path / "runs").exists()


def test_plain_output_never_breaks_a_path(tmp_path: Path) -> None:
    """Off a terminal (a pipe, here), rich wraps and folds nothing: a long path stays
    whole on one line, whatever COLUMNS says."""
    root = tmp_path / ("a-rather-long-folder-name-" * 4) / "runs"
    result = run_areal(
        "train", "recipes/tiny_cpu.yaml", "--dry-run", f"cluster.fileroot={root}",
        env={"COLUMNS": "60"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in ("server-0.log", "trainer.log", "controller.log"):
        assert f"{root}/tiny-cpu/trial0/logs/{name}" in result.stdout
