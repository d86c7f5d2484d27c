"""`areal train` once the recipe is checked: set up the run, start it, watch it, tear down.

Setup: create the run directory and write config.yaml and plan.json (areal_cli.rundir),
build a builtin model into RUN/model, and start every process of the plan (servers and
the torchrun trainer) through the local runner.

With a supervised role (`algorithm: sft` or `rm`) there is no server and no rollout loop: the controller follows the
trainer (areal_cli.launch.follow), with the same watchdog. Otherwise
the controller's rollout loop runs (areal_cli.rollout.controller) with two hooks
from here: one returns when the trainer has exited cleanly and raises as soon as any
child dies; the other is the progress watchdog (areal_cli.launch.watchdog), which reads
the trainer ranks' heartbeats and the client's request counters and stops a run that
makes no progress, naming what is stuck.

Cleanup: on a normal end, a child's failure, a stuck run, Ctrl-C or SIGTERM, every
child's process group is terminated. A failed child is named, with the tail of its log.
Exit codes: 0 done, 1 failed or stuck (--resume continues it), 130 interrupted.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from areal_cli.config.loader import LoadedConfig, to_yaml
from areal_cli.config.schema import SUPERVISED
from areal_cli.launch.local import ChildFailed, LocalRunner
from areal_cli.launch.plan import LaunchPlan, ProcessSpec
from areal_cli.launch.watchdog import RunStuck, watch
from areal_cli.rollout.controller import ServerAddress, run_loop
from areal_cli.rundir import heartbeat
from areal_cli.rundir.layout import initial_model_path, prepare_run_dir, trim_after


def ensure_model(loaded: LoadedConfig, run_dir: Path) -> Path:
    """The initial model folder; builtin models are built into RUN/model once."""
    cfg = loaded.config
    path = Path(initial_model_path(cfg, run_dir))
    if cfg.model.path.startswith("builtin:"):
        from areal_cli.models.builtin import materialize
        from areal_cli.rollout.rewards import numeric

        materialize(cfg.model.path.split(":", 1)[1], cfg.model.seed, path, numeric)
    return path


def child_argv(spec: ProcessSpec, resume: bool) -> list[str]:
    """The spec's argv, with --resume for a resumed trainer."""
    argv = list(spec.argv)
    if spec.name == "trainer" and resume:
        argv.append("--resume")
    return argv


async def _trainer_done(runner: LocalRunner, poll_s: float = 0.2) -> None:
    """Raise ChildFailed as soon as a child dies; return when the trainer exits cleanly."""
    while True:
        runner.check(allow_exit={"trainer"})
        if runner.get("trainer").popen.poll() == 0:
            return
        await asyncio.sleep(poll_s)


def run_training(loaded: LoadedConfig, plan: LaunchPlan, resume: bool, sink: Any) -> int:
    """Run the whole training job; returns the process exit code (0, 1 or 130)."""
    cfg = loaded.config
    run_dir = Path(plan.run_dir)
    start_step = prepare_run_dir(
        run_dir, plan.dirs, to_yaml(cfg), plan.to_dict(secret=cfg.inference.api_key), resume
    )
    if resume:
        trim_after(run_dir, start_step - 1)
    if start_step >= cfg.total_train_steps:
        sink.status(f"nothing to do: the run already finished {start_step} steps")
        return 0
    if cfg.model.path.startswith("builtin:"):
        sink.status(f"preparing {cfg.model.path} (built and cached on first use)")
    ensure_model(loaded, run_dir)
    heartbeat.clear(run_dir)  # an earlier attempt's heartbeats would mislead the watchdog
    servers = [
        ServerAddress(p.name, f"http://127.0.0.1:{p.ports[0]}", p.log)
        for p in plan.processes
        if p.role.startswith("inference")
    ]
    names = {s.address: s.name for s in servers}
    runner = LocalRunner()
    interrupted = {"signal": None}

    def on_signal(signum: int, _frame: Any) -> None:
        interrupted["signal"] = signum
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for spec in plan.processes:
            runner.start(spec, child_argv(spec, resume))
        sink.start(cfg, start_step)
        if cfg.algorithm in SUPERVISED:  # no rollouts: follow the trainer, which reads its data
            from areal_cli.launch.follow import follow_trainer

            loop = follow_trainer(
                run_dir,
                sink,
                until_trainer_done=lambda: _trainer_done(runner),
                guards=[
                    watch(
                        cfg, run_dir, None, {}, lambda: f"no rollouts (algorithm: {cfg.algorithm})"
                    )
                ],
            )
        else:
            loop = run_loop(
                loaded,
                run_dir,
                servers,
                start_step,
                sink,
                check_children=lambda: runner.check(allow_exit={"trainer"}),
                until_trainer_done=lambda: _trainer_done(runner),
                guards=lambda client, state: [watch(cfg, run_dir, client, names, state.describe)],
            )
        asyncio.run(loop)
        sink.finish(run_dir)
        return 0
    except KeyboardInterrupt:
        name = signal.Signals(interrupted["signal"] or signal.SIGINT).name
        sink.error(f"interrupted by {name}; stopping every process")
        return 130
    except ChildFailed as exc:
        sink.error(f"{exc}\n--- last lines of {exc.child.spec.log} ---\n{exc.tail.rstrip()}")
        return 1
    except RunStuck as exc:
        sink.error(f"run stuck: {exc}; stopping every process (areal train --resume continues it)")
        return 1
    except Exception as exc:  # the run started: report, tear down, exit 1
        sink.error(f"run failed: {exc.__class__.__name__}: {exc}")
        return 1
    finally:
        runner.stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.stdout.flush()
