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
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from areal_cli.config.loader import LoadedConfig, to_yaml
from areal_cli.config.model_info import model_config
from areal_cli.config.role_sections import supervised_eval
from areal_cli.config.schema import SUPERVISED, ExperimentConfig
from areal_cli.launch import runs
from areal_cli.launch.local import ChildFailed, LocalRunner, ProcessCancelled
from areal_cli.launch.plan import LaunchPlan, ProcessSpec
from areal_cli.launch.restarts import Restarter
from areal_cli.launch.stop_deadline import StopDeadline, StopSignals
from areal_cli.launch.watchdog import RunStuck, watch
from areal_cli.rollout.controller import LoopHooks, RolloutData, ServerAddress, run_loop
from areal_cli.rollout.metrics import steps_in
from areal_cli.rollout.phases import ServerTurn
from areal_cli.rollout.recovery import ServerRecovery
from areal_cli.rundir import handoff, heartbeat, registry
from areal_cli.rundir.disk import ALL_ENTRIES, DiskProblem, diagnose, is_disk_error, sweep
from areal_cli.rundir.layout import (
    RunClaim,
    initial_model_path,
    prepare_run_dir,
    teacher_model_path,
    trim_after,
)
from areal_cli.rundir.paths import VERSION_PREFIX, RunDir, step_name
from areal_cli.rundir.weight_group import GroupSpec

if TYPE_CHECKING:
    from areal_cli.metrics.display import Sink


def ensure_model(loaded: LoadedConfig, run_dir: Path, say: Callable[[str], None]) -> Path:
    """The initial model folder; builtin models are built into RUN/model once (linked from
    the cache; a build is announced, with its progress)."""
    cfg = loaded.config
    path = Path(initial_model_path(cfg, run_dir))
    from areal_cli.launch import builtins

    if cfg.model.path.startswith("builtin:"):
        builtins.materialize(cfg.model.path, cfg.model.seed, path, say)
    if cfg.teacher.path.startswith("builtin:") and cfg.algorithm in ("grpo", "ppo"):
        teacher = Path(teacher_model_path(cfg, run_dir))
        builtins.materialize(cfg.teacher.path, cfg.model.seed, teacher, say)
    return path


def read_data(
    cfg: ExperimentConfig,
    warn: Callable[[str], None],
    say: Callable[[str], None] = lambda line: None,
) -> RolloutData | None:
    """The rollout's prompts and the tokenizer that made them (None for a supervised role,
    whose trainer reads its data), with every bad row settled by on_bad_row: skipped with
    a warning, or DatasetError. A supervised role's files are checked line by line here
    too (its trainer checks the columns). A builtin model is built first when needed
    (`say` announces it)."""
    from dataclasses import replace

    from areal_cli.data.prompts import load_dataset_prompts, read_rows
    from areal_cli.data.tokenizer import load_tokenizer

    if cfg.algorithm in SUPERVISED:
        held_out, _ = supervised_eval(cfg)
        for path in [cfg.dataset.path] + ([held_out] if held_out else []):
            data = replace(cfg.dataset, path=path)
            read_rows(data, check_columns=False).bad.settle(data.on_bad_row, warn)
        return None
    if cfg.model.path.startswith("builtin:"):  # the tokenizer of the cached build
        from areal_cli.launch import builtins

        source = builtins.cached(cfg.model.path, cfg.model.seed, say)
    else:
        source = cfg.model.path
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or source)
    # online: the outside sessions bring their own prompts (dataset.path is not read)
    online = cfg.rollout.mode == "online"
    prompts = [] if online else load_dataset_prompts(tokenizer, cfg.dataset, warn)
    context = int((model_config(str(source)) or {}).get("max_position_embeddings") or 0)
    ev = cfg.eval
    if not ev.freq_steps:
        return RolloutData(prompts, tokenizer, context_length=context)
    if ev.dataset.path:
        held = load_dataset_prompts(tokenizer, ev.dataset, warn, key="eval.dataset")
    else:
        prompts, held = hold_out(prompts, ev.holdout, cfg.dataset.seed)
    return RolloutData(prompts, tokenizer, held[: ev.max_prompts or None], context)


def hold_out(prompts: list, n: int, seed: int) -> tuple[list, list]:
    """(training prompts, `n` held-out prompts), drawn with `seed`; each keeps its order."""
    import random

    if n >= len(prompts):
        from areal_cli.data.prompts import DatasetError

        raise DatasetError(
            f"eval.holdout {n} leaves no training prompt of the {len(prompts)} usable ones; "
            f"set eval.holdout below {len(prompts)}"
        )
    chosen = set(random.Random(seed).sample(range(len(prompts)), n))
    train = [p for i, p in enumerate(prompts) if i not in chosen]
    return train, [p for i, p in enumerate(prompts) if i in chosen]


def child_argv(spec: ProcessSpec, resume: bool) -> list[str]:
    """The spec's argv, with --resume for a resumed trainer."""
    argv = list(spec.argv)
    if spec.name == "trainer" and resume:
        argv.append("--resume")
    return argv


def _loop(
    loaded: LoadedConfig,
    run_dir: Path,
    servers: list[ServerAddress],
    start_step: int,
    sink: Sink,
    data: RolloutData | None,
    restarter: Restarter,
    backend: str | None,
    weight_group: GroupSpec | None = None,
    colocated: ServerTurn | None = None,
) -> Awaitable[None]:
    """The controller's loop from `start_step`: the rollout loop, or for a supervised role
    the follower of the trainer's lines."""
    cfg = loaded.config
    runner = restarter.runner
    if cfg.algorithm in SUPERVISED:  # no rollouts: follow the trainer, which reads its data
        from areal_cli.launch.follow import follow_trainer

        return follow_trainer(
            run_dir,
            sink,
            until_trainer_done=lambda: _trainer_done(runner),
            guards=[
                watch(cfg, run_dir, None, {}, lambda: f"no rollouts (algorithm: {cfg.algorithm})")
            ],
            counters=restarter.counters,
        )
    if data is None or backend is None:  # check_config rules it out
        raise ValueError(f"algorithm: {cfg.algorithm} needs prompts and an inference server")
    names = {s.address: s.name for s in servers}
    addresses = {s.name: s.address for s in servers}

    async def restart_server(failed: ChildFailed, recovery: ServerRecovery) -> None:
        await restarter.server(failed, recovery, addresses[failed.child.spec.name])

    hooks = LoopHooks(
        check_children=lambda: runner.check(allow_exit={"trainer"}),
        until_trainer_done=lambda recovery: _trainer_done(runner, recovery, restart_server),
        guards=lambda client, state: [watch(cfg, run_dir, client, names, state.describe)],
        counters=restarter.counters,
    )
    return run_loop(
        loaded,
        run_dir,
        servers,
        start_step,
        sink,
        data,
        backend=backend,
        hooks=hooks,
        weight_group=weight_group,
        colocated=colocated,
    )


async def _trainer_done(
    runner: LocalRunner,
    recovery: ServerRecovery | None = None,
    restart_server: Callable[[ChildFailed, ServerRecovery], Awaitable[None]] | None = None,
    poll_s: float = 0.2,
) -> None:
    """Raise ChildFailed as soon as a child dies (a server that `restart_server` brings
    back excepted); return when the trainer exits cleanly."""
    while True:
        try:
            runner.check(allow_exit={"trainer"})
        except ChildFailed as exc:
            is_server = exc.child.spec.role.startswith("inference")
            if not (is_server and recovery is not None and restart_server is not None):
                raise
            await restart_server(exc, recovery)
            continue
        if runner.get("trainer").popen.poll() == 0:
            return
        await asyncio.sleep(poll_s)


def _keep_newest_weights(run_dir: Path) -> None:
    """A finished run keeps only its newest weights/vN: the older ones (keep_last) were
    there for servers still reading them, and nothing reads them once the run is over."""
    for entry in handoff.list_entries(RunDir(run_dir).weights, VERSION_PREFIX)[:-1]:
        handoff.remove_entry(entry.path)


def _resume_line(run_dir: Path, start_step: int, total: int) -> str:
    """Where a resumed run starts, in words (steps counted from 1, as on the console)."""
    if start_step == 1:
        return f"resuming {run_dir}: no recover entry yet, so it starts over from step 1"
    done = start_step - 1
    return (
        f"resuming {run_dir} from recover/{step_name(done)}: {done} of {total} steps "
        f"done, continuing at step {start_step}"
    )


def make_runner(cfg: ExperimentConfig, plan: LaunchPlan) -> LocalRunner:
    """Subprocesses here, job steps inside a Slurm allocation, or Ray actors."""
    if plan.launcher == "slurm":
        from areal_cli.launch.slurm import SlurmRunner

        return SlurmRunner(plan, cfg.launcher.slurm.srun_args)
    if plan.launcher == "ray":
        from areal_cli.launch.ray_cluster import RayRunner

        return RayRunner(cfg, plan)
    return LocalRunner()


def server_addresses(
    cfg: ExperimentConfig, plan: LaunchPlan, runner: LocalRunner
) -> list[ServerAddress]:
    """Where the servers listen: 127.0.0.1 for the local launcher; under a cluster
    launcher, what each server's step wrote in RUN/registry/ (waited for)."""
    specs = [p for p in plan.processes if p.role.startswith("inference")]
    if plan.launcher == "local":
        return [
            ServerAddress(
                p.name,
                f"http://127.0.0.1:{p.ports[0]}",
                p.log,
                plan.served_model,
                plan.group_ranks.get(p.name, 0),
            )
            for p in specs
        ]
    found = registry.wait_for(
        Path(plan.run_dir),
        [p.name for p in specs],
        cfg.launcher.startup_timeout_s,
        check=lambda: runner.check(allow_exit={"trainer"}),
    )
    return [
        ServerAddress(
            p.name,
            registry.url(found[p.name]),
            p.log,
            plan.served_model,
            plan.group_ranks.get(p.name, 0),
        )
        for p in specs
    ]


def _prepare(
    loaded: LoadedConfig, plan: LaunchPlan, resume: bool, sink: Sink
) -> tuple[int, RolloutData | None, RunClaim] | None:
    """Read the data, claim the run directory (RunInUse while another controller holds
    it) and prepare it (a resume forgets the steps it redoes); returns the first step,
    the data and the claim, or None when the run has nothing left to do."""
    cfg = loaded.config
    run_dir = Path(plan.run_dir)
    if resume and len(steps_in(RunDir(run_dir).metrics)) >= cfg.total_train_steps:
        sink.status(
            f"{run_dir} already finished its {cfg.total_train_steps} steps: nothing to do "
            "(raise total_train_steps to train on)"
        )
        return None
    warnings: list[str] = []
    data = read_data(cfg, warnings.append, sink.status)
    claim = RunClaim(run_dir)
    try:
        start_step = prepare_run_dir(
            run_dir, plan.dirs, to_yaml(cfg), plan.to_dict(secret=cfg.inference.api_key), resume
        )
    except BaseException:
        claim.close()
        raise
    for line in warnings:
        sink.warn(line)
    if resume:
        trim_after(run_dir, start_step - 1)
        sink.status(_resume_line(run_dir, start_step, cfg.total_train_steps))
    if start_step > cfg.total_train_steps:
        sink.status(f"nothing to do: the run already finished {start_step - 1} steps")
        claim.close()
        return None
    return start_step, data, claim


def _start_and_train(
    loaded: LoadedConfig,
    plan: LaunchPlan,
    runner: LocalRunner,
    resume: bool,
    sink: Sink,
    start_step: int,
    data: RolloutData | None,
) -> None:
    """Start every process of the plan, then run the loop to the last step, relaunching
    the trainer when it dies (within launcher.restarts); raises what stops the run."""
    cfg = loaded.config
    run_dir = Path(plan.run_dir)
    for spec in plan.processes:
        runner.start(spec, child_argv(spec, resume))
    servers = server_addresses(cfg, plan, runner)
    runs.start_record(cfg, run_dir, str(loaded.recipe), runner.pids(), plan.run_id)
    sink.start(cfg, start_step)
    restarter = Restarter(runner, cfg.launcher.restarts, sink)
    restarter.on_restart = lambda: runs.update_children(run_dir, runner.pids())
    # the servers outlive each loop: whether they are released for a training turn too
    turn = ServerTurn() if plan.allocation.colocated else None
    while True:
        group = GroupSpec.from_json(plan.weight_group) if plan.weight_group else None
        loop = _loop(
            loaded, run_dir, servers, start_step, sink, data, restarter, plan.backend, group,
            colocated=turn,
        )  # fmt: skip
        try:
            asyncio.run(loop)
            break
        except ChildFailed as exc:
            if exc.child.spec.name != "trainer":
                raise
            argv = child_argv(exc.child.spec, resume=True)
            start_step = restarter.trainer(exc, run_dir, argv)
    _keep_newest_weights(run_dir)
    sink.finish(run_dir)


def run_training(
    loaded: LoadedConfig,
    plan: LaunchPlan,
    resume: bool,
    sink: Sink,
    resume_command: str = "",
) -> int:
    """Run the whole training job; returns the process exit code (0, 1 or 130). A dataset
    that cannot be used raises DatasetError before anything is written or started.
    `resume_command` (the command line that continues the run) is shown after a stop."""
    cfg = loaded.config
    run_dir = Path(plan.run_dir)
    resume_command = resume_command or "areal train RECIPE --resume"
    prepared = _prepare(loaded, plan, resume, sink)
    if prepared is None:
        return 0
    start_step, data, claim = prepared  # held until this function returns
    ensure_model(loaded, run_dir, sink.status)
    heartbeat.clear(run_dir)  # an earlier attempt's heartbeats would mislead the watchdog
    registry.clear(run_dir)
    try:
        runner = make_runner(cfg, plan)
    except Exception as exc:  # a cluster that cannot be reached or cannot hold the plan
        sink.error(f"could not start the {plan.launcher} launcher: {exc}")
        claim.close()
        return 1

    def force_stop() -> None:  # the deadline's, from its thread: kill, record the end
        runner.stop_all(grace_s=2.0)
        runs.end_record(run_dir, StopDeadline.EXIT_CODE)

    stop_file = RunDir(run_dir).logs / "controller.stop-stack"
    deadline = StopDeadline(force_stop, stop_file, resume_command, cfg.launcher.stop_timeout_s)
    stops = StopSignals(deadline)  # Ctrl-C, areal stop, a closed terminal
    stops.install()
    try:
        _start_and_train(loaded, plan, runner, resume, sink, start_step, data)
        return 0
    except KeyboardInterrupt:  # a stop that was asked for: not an error
        deadline.disarm()  # the loop has unwound; stopping the children is bounded
        runner.stop_all()
        sink.notice(f"stopped by {stops.name}; every process of the run has ended")
        sink.notice(f"continue it with: {resume_command}")
        return 130
    except ProcessCancelled as exc:  # e.g. Slurm's scancel of one step
        sink.error(f"{exc}; stopping every process")
        return 130
    except ChildFailed as exc:
        sink.error(f"{exc}\n--- last lines of {exc.child.spec.log} ---\n{exc.tail.rstrip()}")
        return 1
    except DiskProblem as exc:
        sink.error(f"run stopped: {exc}")
        return 1
    except RunStuck as exc:
        sink.error(f"run stuck: {exc}; stopping every process (continue it with: {resume_command})")
        return 1
    except Exception as exc:  # the run started: report, tear down, exit 1
        if is_disk_error(exc):
            runner.stop_all()  # the writers stop before their leftovers are swept
            problem = diagnose(run_dir, exc)
            if problem is not None:
                sink.error(f"run stopped: {problem}")
                return 1
        sink.error(f"run failed: {exc.__class__.__name__}: {exc}")
        return 1
    finally:
        deadline.disarm()
        runner.stop_all()
        sweep(run_dir, ALL_ENTRIES)  # unfinished writes of the stopped writers
        stops.restore()
        claim.close()
        sys.stdout.flush()
