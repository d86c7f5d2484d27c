"""Render a LaunchPlan for people: a rich table plus each command line and environment."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from areal_cli.config.schema import SUPERVISED
from areal_cli.launch.plan import REDACTED, LaunchPlan
from areal_cli.metrics.display import make_console
from areal_cli.rundir.paths import RunDir
from areal_cli.rundir.weight_group import PROTOCOLS, TORCH_GROUP


def print_plan(
    plan: LaunchPlan, console: Console, *, secret: str = "", trainer: list[str] | None = None
) -> None:
    """Print processes, devices, ports, logs, command lines, the trainer's layout (the
    lines of `layout.describe`, when the model's sizes are known) and directories."""
    console.print(
        f"[bold]Launch plan[/bold] {plan.experiment_name}/{plan.trial_name}  "
        f"allocation [cyan]{plan.allocation_mode}[/cyan] on {plan.device_type}"
    )
    table = Table(show_lines=False)
    for column in ("process", "role", "devices", "ports", "log"):
        table.add_column(column, overflow="fold")
    controller = "this process (areal train)"
    if plan.launcher == "slurm":
        controller = "the Slurm job's batch step (node 0); each process below is a job step"
    elif plan.launcher == "ray":
        controller += "; each process below runs in a Ray actor of one placement group"
    if plan.algorithm == "ppo":
        console.print(
            "algorithm ppo: the critic (a value model) trains on the trainer's ranks, beside the actor"
        )
    if plan.algorithm in SUPERVISED:
        console.print(
            f"algorithm {plan.algorithm}: no inference server; the trainer reads the dataset itself"
        )
        controller += ", follows the trainer"
    table.add_row("controller", controller, "-", "-", f"{plan.run_dir}/logs/controller.log")
    for proc in plan.processes:
        devices = proc.devices
        if plan.launcher == "slurm":  # which of the job's nodes (0 is the controller's)
            devices = f"node {','.join(map(str, proc.nodes))}: {devices}"
        elif plan.launcher == "ray":  # Ray picks the node of each bundle
            devices = f"ray bundle {plan.processes.index(proc)}: {devices}"
        ports = ",".join(map(str, proc.ports)) or (
            "free (torchrun)" if proc.name == "trainer" else "-"
        )
        table.add_row(proc.name, proc.role, devices, ports, proc.log)
    console.print(table)
    if plan.weight_group:
        g = plan.weight_group
        members = ", ".join(
            ["trainer rank 0: 0"] + [f"{name}: {rank}" for name, rank in plan.group_ranks.items()]
        )
        how = f"{g['backend']} ({PROTOCOLS[g.get('protocol', TORCH_GROUP)]})"
        console.print(
            f"weight update: distributed over {how}, group {g['group_name']} of "
            f"{g['world_size']} on {g['master_address']}:{g['master_port']} (the trainer's "
            f"rank 0 hosts it); ranks: {members}; timeout {g['timeout_s']:g} s",
            markup=False,
        )

    for proc in plan.processes:
        argv = [REDACTED if secret and a == secret else a for a in proc.argv]
        console.print(f"[bold]{proc.name}[/bold] command:", soft_wrap=True)
        console.print("  " + shlex.join(argv), soft_wrap=True, markup=False, highlight=False)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(proc.env.items()))
        console.print(f"  env: {env}", soft_wrap=True, markup=False, highlight=False)
    if trainer:
        console.print("[bold]Trainer layout[/bold]")
        for line in trainer:
            console.print("  " + line, markup=False, highlight=False)
    console.print("[bold]Directories[/bold] (created by a real run, not by --dry-run):")
    for directory in plan.dirs:
        console.print(f"  {directory}", markup=False, highlight=False)


def trainer_memory_lines(cfg: Any, plan: LaunchPlan) -> list[str]:
    """A trainer rank's parameters, gradients and optimizer state, when the model's
    config.json is here (config.phase_memory; LoRA counts the adapters' state only)."""
    from areal_cli.config.model_info import model_config
    from areal_cli.config.phase_memory import trainer_line

    config = model_config(cfg.model.path)
    if plan.allocation.train is None or not config:
        return []
    try:
        return [trainer_line(cfg, config, plan.allocation.train.world_size)]
    except (KeyError, TypeError, ZeroDivisionError):
        return []  # not a Llama-style config


def colocation_lines(cfg: Any, plan: LaunchPlan) -> list[str]:
    """What a colocated plan ('|') shares, and its memory per phase when the model's sizes
    are known here (config.phase_memory)."""
    if not plan.allocation.colocated:
        return []
    from areal_cli.config.model_info import model_config
    from areal_cli.config.phase_memory import estimate

    devices = "GPUs" if plan.device_type == "cuda" else "CPU cores"
    lines = [
        f"colocated: the servers and the trainer share the same {devices} and take turns "
        "(rollout, then a training step, then the new weights; synchronous RL, "
        "max_staleness 0): each phase has them all"
    ]
    config = model_config(cfg.model.path)
    try:
        memory = estimate(cfg, plan.allocation, config) if config else None
    except (KeyError, TypeError, ZeroDivisionError):
        memory = None  # not a Llama-style config
    if memory is None:
        return lines + [
            "memory per phase: unknown here (the model's config.json is not on this machine)"
        ]
    return lines + memory.lines(plan.device_type)


def print_dry_run(
    loaded: Any,
    plan: LaunchPlan,
    recipe: Path,
    overrides: list[str],
    resume: bool,
    json_out: bool,
    trainer: list[str] | None,
) -> None:
    """`areal train --dry-run`: the plan (a table, or JSON), and under Slurm the batch
    script that would be submitted. Nothing is written or submitted."""
    secret = loaded.config.inference.api_key
    script = None
    if plan.launcher == "slurm":
        from areal_cli.launch.slurm import job_command, render_sbatch

        command = job_command(recipe, overrides, resume)
        script = render_sbatch(loaded.config, plan, command, os.getcwd())
    if json_out:
        data = plan.to_dict(secret=secret)
        data["trainer_memory"] = trainer_memory_lines(loaded.config, plan)
        if plan.allocation.colocated:
            data["colocation"] = colocation_lines(loaded.config, plan)
        if script is not None:
            data["sbatch_script"] = script
        print(json.dumps(data, indent=2))
        return
    console = make_console()
    print_plan(plan, console, secret=secret, trainer=trainer)
    for line in [
        *trainer_memory_lines(loaded.config, plan),
        *colocation_lines(loaded.config, plan),
    ]:
        console.print(line, markup=False, highlight=False)
    rollout = loaded.config.rollout
    if rollout.mode == "online":
        where = f"{rollout.proxy.host}:{rollout.proxy.port or 'a free port'}"
        key = "the admin key" if rollout.proxy.admin_api_key else "no key (loopback)"
        console.print(
            f"online: outside clients drive sessions at the agent proxy ({where}, its "
            f"address in RUN/proxy.json); POST /rl/start_session with {key}; groups of "
            f"{rollout.group_size} sessions; {rollout.session_timeout_s:g} s session timeout",
            markup=False,
        )
    elif rollout.agent:
        where = f"{rollout.proxy.host}:{rollout.proxy.port or 'a free port'}"
        if rollout.mode == "subproc":
            console.print(
                f"subprocess agents: {rollout.subproc_max_workers} worker processes, one "
                "episode each at a time",
                markup=False,
            )
        console.print(
            f"agent proxy: {where} in the controller, OpenAI routes for {rollout.agent} "
            f"(samples {rollout.agent_samples}, tool calls {rollout.tool_parser}, "
            f"{rollout.agent_timeout_s:g} s per episode)",
            markup=False,
        )
    launcher = loaded.config.launcher
    if not (launcher.inference_base_port and launcher.trainer_port):
        console.print(
            "ports: launcher ports left at 0 are free ones picked now; a launch picks again",
            markup=False,
        )
    if script is not None:
        job = RunDir(Path(plan.run_dir)).sbatch
        console.print(f"[bold]Slurm batch script[/bold] (written to {job} and given to sbatch):")
        console.print(script, markup=False, highlight=False, soft_wrap=True)
