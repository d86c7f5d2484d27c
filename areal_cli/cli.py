"""The `areal` command line. Commands are thin: they load, check, and hand off.

Heavy modules (torch, transformers, sglang) are imported inside the functions that need
them, never at module level, so `areal --help` stays fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from areal_cli.config.loader import LoadedConfig
    from areal_cli.config.validate import CheckResult

app = typer.Typer(
    name="areal",
    help="Asynchronous RL for language models: one YAML recipe, one command.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

RECIPE = typer.Argument(..., help="Recipe YAML file.", show_default=False, metavar="RECIPE.yaml")
OVERRIDES = typer.Argument(
    None,
    help="Overrides as key.path=value (highest precedence).",
    show_default=False,
    metavar="KEY=VALUE",
)

EXIT_BAD_INPUT = 2


def _fail(problems: list, context: str) -> None:
    """Print one line per problem to stderr and exit 2."""
    for problem in problems:
        typer.echo(f"error: {problem.format()}", err=True)
    noun = "problem" if len(problems) == 1 else "problems"
    typer.echo(f"areal: {len(problems)} {noun} found {context}; nothing was started.", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def _load_and_check(
    recipe: Path, overrides: list[str] | None, command: str, launch: bool
) -> tuple[LoadedConfig, CheckResult]:
    from areal_cli.config.errors import ConfigErrors
    from areal_cli.config.loader import load_config
    from areal_cli.config.validate import check_config

    try:
        loaded = load_config(recipe, overrides or [])
        problems = []
    except ConfigErrors as exc:
        if exc.partial is None:  # values are broken: cross-field checks would mislead
            _fail(exc.problems, f"in {recipe}")
        loaded, problems = exc.partial, exc.problems
    result = check_config(loaded, command=command, launch=launch)
    for warning in result.warnings:
        typer.echo(f"warning: {warning.format()}", err=True)
    if problems or result.problems:
        _fail(problems + result.problems, f"in {recipe}")
    return loaded, result


@app.command()
def validate(recipe: Path = RECIPE, overrides: list[str] = OVERRIDES) -> None:
    """Resolve and check a recipe, then print the resolved config. Starts nothing."""
    from areal_cli.config.loader import to_yaml

    loaded, result = _load_and_check(recipe, overrides, "validate", launch=False)
    typer.echo(to_yaml(loaded.config), nl=False)
    note = f" ({len(result.warnings)} warnings)" if result.warnings else ""
    typer.echo(f"# ok: {recipe} is valid{note}", err=True)


@app.command()
def train(
    recipe: Path = RECIPE,
    overrides: list[str] = OVERRIDES,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the launch plan and exit; start and write nothing."
    ),
    json_out: bool = typer.Option(False, "--json", help="With --dry-run: print the plan as JSON."),
) -> None:
    """Train with asynchronous RL as the recipe says."""
    from areal_cli.launch.plan import build_plan

    loaded, result = _load_and_check(recipe, overrides, "train", launch=not dry_run)
    plan = build_plan(loaded.config, result.allocation)
    secret = loaded.config.inference.api_key
    if dry_run:
        if json_out:
            typer.echo(plan.to_json(secret=secret))
        else:
            from rich.console import Console

            from areal_cli.launch.display import print_plan

            print_plan(plan, Console(), secret=secret)
        return
    typer.echo(
        "error: this build of areal can plan a run (--dry-run) but does not yet contain the "
        "controller that executes the plan; run with --dry-run",
        err=True,
    )
    raise typer.Exit(1)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="areal")


if __name__ == "__main__":
    sys.exit(main())
