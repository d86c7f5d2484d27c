"""The controller: `areal train` runs this. Setup, then the loop, then cleanup.

Setup: create the run directory, write config.yaml and plan.json, build a builtin model,
start every child of the plan (servers and the torchrun trainer) and wait until the
servers are healthy.

Loop (asyncio), three tasks:
  rollouts  draw prompts, run `group_size` episodes each, score them, and write trainer
            batches RUN/rollouts/step-N (handoff protocol);
  weights   when the trainer publishes RUN/weights/vN, load it on every server with
            /update_weights_from_disk and check each reports vN;
  metrics   when the trainer finishes step N, join its stats with the rollout stats of
            batch N into one line of RUN/metrics.jsonl, TensorBoard and the display.

Staleness rule: a group started while the servers hold weight version v may feed trainer
step s only if s - v <= rollout.max_staleness. The rollout task starts a new group only
while the groups started so far fit in the steps that version v may still feed, and it
drops (and counts) any group that finished too late. Step s trains the weights of version
s, so with max_staleness 0 every batch is generated entirely by the current weights:
synchronous RL.

Cleanup: on a normal end, a child's failure, Ctrl-C or SIGTERM, every child's process
group is terminated. A failed child is named, with the tail of its log.

Resume: the trainer restores RUN/recover/step-N and republishes weights v(N+1); the
controller drops rollouts and metrics after step N, restores the dataset position saved
with batch N, and continues at step N+1. Prompts that were in flight when the run died
are skipped, not replayed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_cli.config.allocation import AllocationMode
from areal_cli.config.loader import LoadedConfig, to_yaml
from areal_cli.launch.local import ChildFailed, LocalRunner
from areal_cli.launch.plan import LaunchPlan, initial_model_path
from areal_cli.rollout.workflows import EpisodeClient, Trajectory, resolve_workflow
from areal_cli.weights import handoff


class RunFailed(RuntimeError):
    """The run failed after it started; the message says which process and where its log is."""


@dataclass
class Group:
    """The trajectories of one prompt and the version the servers held when it started."""

    trajectories: list[Trajectory]
    start_version: int
    prompt_index: int

    @property
    def oldest_version(self) -> int:
        return min([self.start_version] + [t.oldest_version for t in self.trajectories])


@dataclass
class LoopState:
    """What the three loop tasks share."""

    version: int  # weight version every server holds (-1: not yet known after a resume)
    next_step: int
    launched: int = 0
    in_flight: int = 0
    ready: deque = field(default_factory=deque)
    dropped_stale: int = 0
    gate_wait_s: float = 0.0
    batch_stats: dict[int, dict[str, float]] = field(default_factory=dict)
    handoff: dict[int, dict[str, float]] = field(default_factory=dict)
    version_changed: asyncio.Event = field(default_factory=asyncio.Event)
    group_done: asyncio.Event = field(default_factory=asyncio.Event)
    last_batch_time: float = field(default_factory=time.perf_counter)


# ---------------------------------------------------------------------------- setup


def prepare_run_dir(loaded: LoadedConfig, plan: LaunchPlan, resume: bool) -> int:
    """Create the run tree and write config.yaml and plan.json; returns the first step."""
    run_dir = Path(plan.run_dir)
    started = (run_dir / "weights").is_dir() and any((run_dir / "weights").iterdir())
    if started and not resume:
        raise FileExistsError(
            f"{run_dir} already holds a run; add --resume to continue it, or set another trial_name"
        )
    for directory in plan.dirs:
        Path(directory).mkdir(parents=True, exist_ok=True)
    handoff.write_json_atomic(
        run_dir / "plan.json", plan.to_dict(secret=loaded.config.inference.api_key)
    )
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(to_yaml(loaded.config))
    os.replace(tmp, run_dir / "config.yaml")
    if not resume:
        return 0
    entry = handoff.latest(run_dir / "recover", "step-")
    return entry.version + 1 if entry else 0


def trim_after(run_dir: Path, last_step: int) -> None:
    """Forget rollouts and metrics of steps after `last_step` (they will be redone)."""
    for entry in handoff.list_entries(run_dir / "rollouts", "step-"):
        if entry.version > last_step:
            handoff.remove_entry(entry.path)
    for entry in handoff.list_entries(run_dir / "weights", "v"):
        if entry.version > last_step + 1:  # trained after the checkpoint: will be redone
            handoff.remove_entry(entry.path)
    for name in ("metrics.jsonl", "logs/trainer-metrics.jsonl"):
        path = run_dir / name
        if path.exists():
            keep = [
                line
                for line in path.read_text().splitlines()
                if line and json.loads(line)["step"] <= last_step
            ]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, path)


def ensure_model(loaded: LoadedConfig, run_dir: Path) -> Path:
    """The initial model folder; builtin models are built into RUN/model once."""
    cfg = loaded.config
    path = Path(initial_model_path(cfg, run_dir))
    if cfg.model.path.startswith("builtin:") and not (path / "config.json").exists():
        from transformers.utils import logging as hf_logging

        from areal_cli.inference.tiny_model import build_tiny_model

        hf_logging.disable_progress_bar()
        build_tiny_model(path, preset=cfg.model.path.split(":", 1)[1], seed=cfg.model.seed)
    return path


def child_argv(loaded: LoadedConfig, spec: Any, resume: bool) -> list[str]:
    """The spec's argv, with --resume for a resumed trainer."""
    argv = list(spec.argv)
    if spec.name == "trainer" and resume:
        argv.append("--resume")
    return argv


# ---------------------------------------------------------------------------- rollouts


async def run_group(
    ctx: RolloutContext, prompt: Any, group_index: int, start_version: int
) -> Group:
    """`group_size` episodes of one prompt, concurrently, each with its own sampling seed."""
    cfg = ctx.cfg
    sample = {
        "prompt_ids": prompt.input_ids,
        "answer": prompt.answer,
        "row": prompt.row,
        "index": prompt.index,
    }
    episodes = []
    for i in range(cfg.rollout.group_size):
        seed = (cfg.seed * 1_000_003 + group_index * 997 + i * 31) % (2**31)
        client = EpisodeClient(ctx.inference, ctx.tokenizer, cfg.gconfig, ctx.rewards, seed)
        episodes.append(ctx.workflow(client, sample))
    return Group(list(await asyncio.gather(*episodes)), start_version, prompt.index)


@dataclass
class RolloutContext:
    """Long-lived objects of the rollout loop."""

    cfg: Any
    run_dir: Path
    inference: Any
    tokenizer: Any
    rewards: Any
    workflow: Any
    stream: Any
    total_steps: int


def _may_launch(ctx: RolloutContext, state: LoopState) -> bool:
    """The staleness gate and the concurrency cap (see the module docstring)."""
    r = ctx.cfg.rollout
    if state.version < 0:
        return False
    cap = r.max_concurrent_rollouts or r.batch_size * (r.max_staleness + 1)
    usable_steps = min(state.version + r.max_staleness + 1, ctx.total_steps) - state.next_step
    already = state.in_flight + len(state.ready)
    return state.in_flight < cap and already < usable_steps * r.batch_size


async def rollout_task(ctx: RolloutContext, state: LoopState) -> None:
    """Launch groups as the gate allows; assemble and write batches in order."""
    tasks: set[asyncio.Task] = set()
    group_index = state.next_step * ctx.cfg.rollout.batch_size
    try:
        while state.next_step < ctx.total_steps:
            while _may_launch(ctx, state):
                prompt = ctx.stream.next_batch(1)[0]
                task = asyncio.create_task(run_group(ctx, prompt, group_index, state.version))
                group_index += 1
                state.in_flight += 1
                tasks.add(task)
                task.add_done_callback(lambda t, s=state: _on_group_done(t, s, tasks))
            if _assemble_batch(ctx, state):
                continue
            idle = state.in_flight == 0  # nothing running: we wait on the trainer's weights
            waited = time.perf_counter()
            state.group_done.clear()
            state.version_changed.clear()
            await _wait_any(state.group_done, state.version_changed)
            if idle:
                state.gate_wait_s += time.perf_counter() - waited
    finally:
        for task in tasks:
            task.cancel()


def _on_group_done(task: asyncio.Task, state: LoopState, tasks: set) -> None:
    tasks.discard(task)
    state.in_flight -= 1
    if not task.cancelled():
        if task.exception() is not None:
            state.ready.append(task.exception())
        else:
            state.ready.append(task.result())
    state.group_done.set()


async def _wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def _assemble_batch(ctx: RolloutContext, state: LoopState) -> bool:
    """Write batch `next_step` if enough fresh groups are ready; drop stale ones."""
    r = ctx.cfg.rollout
    step = state.next_step
    fresh = deque()
    while state.ready:
        group = state.ready.popleft()
        if isinstance(group, BaseException):
            raise RunFailed(f"a rollout failed: {group}") from group
        if step - group.oldest_version > r.max_staleness:
            state.dropped_stale += 1
            continue
        fresh.append(group)
    state.ready = fresh
    if len(state.ready) < r.batch_size:
        return False
    groups = [state.ready.popleft() for _ in range(r.batch_size)]
    write_rollout_batch(ctx, state, step, groups)
    state.next_step += 1
    return True


def write_rollout_batch(
    ctx: RolloutContext, state: LoopState, step: int, groups: list[Group]
) -> None:
    """Pack the groups into RUN/rollouts/step-N and remember their stats."""
    import torch

    from areal_cli.trainer.batch import RolloutBatch, write_batch

    trajs = [t for g in groups for t in g.trajectories]
    seqs = [
        {
            "input_ids": torch.tensor(t.input_ids, dtype=torch.int64),
            "loss_mask": torch.tensor(t.loss_mask, dtype=torch.int8),
            "logprobs": torch.tensor(t.logprobs, dtype=torch.float32),
            "versions": torch.tensor(t.versions, dtype=torch.int32),
        }
        for t in trajs
    ]
    rewards = [t.reward for t in trajs]
    batch = RolloutBatch.from_sequences(seqs, rewards, ctx.cfg.rollout.group_size)
    staleness = [step - g.oldest_version for g in groups]
    now = time.perf_counter()
    generated = sum(t.n_generated for t in trajs)
    stats = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "staleness_mean": statistics.fmean(staleness),
        "staleness_max": float(max(staleness)),
        "gen_tokens": float(generated),
        "gen_tokens_per_s": generated / max(now - state.last_batch_time, 1e-6),
        "reward_errors": float(sum(t.reward_failed for t in trajs)),
        "reward_timeouts": float(sum(t.reward_timed_out for t in trajs)),
        "dropped_stale": float(state.dropped_stale),
        "controller_wait_s": state.gate_wait_s,
    }
    state.last_batch_time = now
    state.gate_wait_s = 0.0
    t0 = time.perf_counter()
    write_batch(
        ctx.run_dir / "rollouts",
        step,
        batch,
        {"data_state": ctx.stream.state_dict(), "stats": stats},
    )
    stats["rollout_save_s"] = time.perf_counter() - t0
    state.batch_stats[step] = stats
    handoff.gc(
        ctx.run_dir / "rollouts",
        "step-",
        keep_last=ctx.cfg.rollout.max_staleness + 2 + ctx.cfg.recover.freq_steps,
    )


# ---------------------------------------------------------------------------- weights


async def weights_task(ctx: RolloutContext, state: LoopState, poll_s: float = 0.01) -> None:
    """Load every newly published weights/vN on all servers and check they report it."""
    weights_dir = ctx.run_dir / "weights"
    while True:
        entry = handoff.latest(weights_dir, "v")
        if entry is not None and entry.version > state.version:
            t0 = time.perf_counter()
            await ctx.inference.update_weights_from_disk(str(entry.path), entry.version)
            infos = await ctx.inference.model_info()
            reported = {str(info.get("weight_version")) for info in infos}
            if reported != {str(entry.version)}:
                raise RunFailed(
                    f"servers report weight versions {sorted(reported)} after loading v{entry.version}"
                )
            load_s = time.perf_counter() - t0
            state.handoff[entry.version] = {
                "handoff_load_s": load_s,
                "handoff_latency_s": time.time() - float(entry.manifest["created"]) + 0.0,
            }
            state.version = entry.version
            state.version_changed.set()
        await asyncio.sleep(poll_s)


# ---------------------------------------------------------------------------- metrics


METRIC_KEYS = (
    "loss",
    "grad_norm",
    "clip_frac",
    "entropy",
    "imp_weight_mean",
    "imp_weight_max",
    "padding_fraction",
    "tokens",
    "kl",
)


async def metrics_task(
    ctx: RolloutContext, state: LoopState, sink: Any, poll_s: float = 0.1
) -> None:
    """Join trainer stats and rollout stats per step into metrics.jsonl and the display."""
    trainer_file = ctx.run_dir / "logs" / "trainer-metrics.jsonl"
    done = _steps_in(ctx.run_dir / "metrics.jsonl")
    pending: dict[int, dict] = {}
    offset = 0
    while True:
        lines, offset = _read_new_lines(trainer_file, offset)
        for line in lines:
            record = json.loads(line)
            if record["step"] not in done:
                pending[record["step"]] = record
        # A step's line is complete once the servers loaded the weights it produced.
        for step in sorted(s for s in pending if s + 1 in state.handoff):
            record = pending.pop(step)
            metrics = build_metrics(
                record, state.batch_stats.get(step, {}), state.handoff[step + 1]
            )
            with open(ctx.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            done.add(step)
            sink.step(metrics)
        await asyncio.sleep(poll_s)


def build_metrics(trainer: dict, rollout: dict, handoff_stats: dict) -> dict[str, float]:
    """One metrics.jsonl line: rollout, trainer and handoff figures of one step."""
    out: dict[str, Any] = {"step": trainer["step"], "weight_version": trainer["weight_version"]}
    out.update({k: rollout[k] for k in rollout})
    out.update({k: trainer[k] for k in METRIC_KEYS if k in trainer})
    out["trainer_step_s"] = trainer["train_s"]
    out["trainer_wait_s"] = trainer["wait_s"]
    out["handoff_save_s"] = trainer["publish_s"]
    out.update(handoff_stats)
    out["time"] = time.time()
    return out


def _steps_in(path: Path) -> set[int]:
    if not path.exists():
        return set()
    return {json.loads(line)["step"] for line in path.read_text().splitlines() if line}


def _read_new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines appended to `path` since `offset`."""
    if not path.exists():
        return [], offset
    with open(path) as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind("\n") + 1]
    return [line for line in complete.splitlines() if line], offset + len(complete.encode())


# ---------------------------------------------------------------------------- the run


async def _watch_children(runner: LocalRunner, poll_s: float = 0.2) -> None:
    """Raise ChildFailed as soon as a child dies; return when the trainer exits cleanly."""
    while True:
        runner.check(allow_exit={"trainer"})
        if runner.get("trainer").popen.poll() == 0:
            return
        await asyncio.sleep(poll_s)


async def _run_loop(
    loaded: LoadedConfig, plan: LaunchPlan, runner: LocalRunner, start_step: int, sink: Any
) -> None:
    import datasets

    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.data import PromptStream, load_prompts, prepare_prompts
    from areal_cli.rollout.rewards import RewardPool

    datasets.disable_progress_bars()
    cfg = loaded.config
    run_dir = Path(plan.run_dir)
    servers = [p for p in plan.processes if p.role.startswith("inference")]
    addresses = [f"http://127.0.0.1:{p.ports[0]}" for p in servers]
    logs = {a: p.log for a, p in zip(addresses, servers, strict=True)}
    client = InferenceClient(
        addresses,
        api_key=cfg.inference.api_key,
        timeout_s=cfg.rollout.request_timeout_s,
        retries=cfg.rollout.request_retries,
        logs=logs,
    )
    rewards = RewardPool.from_config(cfg.reward, loaded.recipe.resolve().parent)
    try:
        sink.status("waiting for inference servers")
        await client.wait_healthy(
            cfg.launcher.startup_timeout_s, on_poll=lambda _: runner.check(allow_exit={"trainer"})
        )
        tokenizer = _load_tokenizer(cfg, run_dir)
        prompts, skipped = prepare_prompts(tokenizer, load_prompts(cfg.dataset), cfg.dataset)
        if not prompts:
            raise RunFailed(
                f"no prompt of {cfg.dataset.path} fits dataset.max_prompt_len={cfg.dataset.max_prompt_len}"
            )
        stream = PromptStream.from_config(prompts, cfg.dataset)
        _restore_stream(stream, run_dir, start_step)
        workflow = resolve_workflow(
            cfg.rollout.workflow, loaded.recipe.resolve().parent, cfg.rollout.max_turns
        )
        ctx = RolloutContext(
            cfg, run_dir, client, tokenizer, rewards, workflow, stream, cfg.total_train_steps
        )
        state = LoopState(version=0 if start_step == 0 else -1, next_step=start_step)
        sink.status(f"training ({len(prompts)} prompts, {skipped} too long)")
        tasks = [
            asyncio.create_task(rollout_task(ctx, state)),
            asyncio.create_task(weights_task(ctx, state)),
            asyncio.create_task(metrics_task(ctx, state, sink)),
        ]
        watcher = asyncio.create_task(_watch_children(runner))
        try:
            while not watcher.done():
                done, _ = await asyncio.wait([watcher, *tasks], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not watcher and task.exception() is not None:
                        raise task.exception()
                tasks = [t for t in tasks if not t.done()]
            watcher.result()
            await asyncio.sleep(0.3)  # let the metrics task read the trainer's last line
            lines, _ = _read_new_lines(run_dir / "logs" / "trainer-metrics.jsonl", 0)
            await _drain_metrics(ctx, state, sink, len(lines))
        finally:
            for task in [*tasks, watcher]:
                task.cancel()
            await asyncio.gather(*tasks, watcher, return_exceptions=True)
    finally:
        rewards.close()
        await client.close()


async def _drain_metrics(
    ctx: RolloutContext, state: LoopState, sink: Any, expected: int, timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_steps_in(ctx.run_dir / "metrics.jsonl")) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def _load_tokenizer(cfg: Any, run_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        cfg.model.tokenizer_path or initial_model_path(cfg, run_dir)
    )


def _restore_stream(stream: Any, run_dir: Path, start_step: int) -> None:
    if start_step == 0:
        return
    entry = handoff.latest(run_dir / "rollouts", "step-")
    if entry is not None and entry.version == start_step - 1 and "data_state" in entry.meta:
        stream.load_state_dict(entry.meta["data_state"])


def run_training(
    loaded: LoadedConfig, plan: LaunchPlan, mode: AllocationMode, resume: bool, sink: Any
) -> int:
    """Run the whole training job; returns the process exit code (0, 1 or 130)."""
    run_dir = Path(plan.run_dir)
    start_step = prepare_run_dir(loaded, plan, resume)
    if resume:
        trim_after(run_dir, start_step - 1)
    if start_step >= loaded.config.total_train_steps:
        sink.status(f"nothing to do: the run already finished {start_step} steps")
        return 0
    ensure_model(loaded, run_dir)
    runner = LocalRunner()
    interrupted = {"signal": None}

    def on_signal(signum: int, _frame: Any) -> None:
        interrupted["signal"] = signum
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for spec in plan.processes:
            runner.start(spec, child_argv(loaded, spec, resume))
        sink.start(loaded.config, start_step)
        asyncio.run(_run_loop(loaded, plan, runner, start_step, sink))
        sink.finish(run_dir)
        return 0
    except KeyboardInterrupt:
        sink.error(
            f"interrupted by {signal.Signals(interrupted['signal'] or signal.SIGINT).name}; stopping every process"
        )
        return 130
    except ChildFailed as exc:
        sink.error(f"{exc}\n--- last lines of {exc.child.spec.log} ---\n{exc.tail.rstrip()}")
        return 1
    except Exception as exc:  # the run started: report, tear down, exit 1
        sink.error(f"run failed: {exc.__class__.__name__}: {exc}")
        return 1
    finally:
        runner.stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.stdout.flush()
