"""The controller's rollout loop: what `areal train` runs once its processes are up.

launch/train.py prepares the run directory, starts the servers and the trainer, and then
runs `run_loop` with two hooks of its own: one that returns when the trainer has finished
(and raises when a child died), and guards that run beside the loop (the watchdog).

Loop (asyncio), three tasks:
  rollouts  draw prompts, run `group_size` episodes each, score them, and write trainer
            batches RUN/rollouts/step-N (handoff protocol);
  weights   when the trainer publishes RUN/weights/vN, load it on every server with
            /update_weights_from_disk and check each reports vN;
  metrics   when the trainer finishes step N, join its stats with the rollout stats of
            batch N into one line of RUN/metrics.jsonl, TensorBoard and the display.

Staleness rule (areal_cli.rollout.gate): steps count from 1, and step k trains the weights
of version k-1, so a group started while the servers hold version v may feed step k only
if k-1-v <= rollout.max_staleness. The rollout task starts a new group only while the
groups started so far fit in the steps that version v may still feed, and it drops (and
counts) any group that finished too late. With max_staleness 0 every batch is generated
entirely by the current weights: synchronous RL.

Resume: the trainer restores RUN/recover/step-K and republishes its weights as vK; the
loop starts at step K+1 with the dataset position saved with batch K. Prompts that were in
flight when the run died are skipped, not replayed.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from areal_cli.config.loader import LoadedConfig
from areal_cli.config.schema import ExperimentConfig
from areal_cli.rollout.errors import RunFailed
from areal_cli.rollout.gate import StalenessGate
from areal_cli.rollout.recovery import ServerRecovery
from areal_cli.rollout.workflows import EpisodeClient, Trajectory, Workflow, resolve_workflow
from areal_cli.rundir import handoff
from areal_cli.rundir.paths import STEP_PREFIX, VERSION_PREFIX, RunDir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from areal_cli.data.prompts import Prompt, PromptStream
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.rewards import RewardPool


@dataclass
class Group:
    """The trajectories of one prompt and the version the servers held when it started."""

    trajectories: list[Trajectory]
    start_version: int
    prompt_index: int

    @property
    def oldest_version(self) -> int:
        return min([self.start_version] + [t.oldest_version for t in self.trajectories])


GEN_RATE_WINDOW = 5  # batches that gen_tokens_per_s is measured over


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
    weights_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # loads on the servers
    group_done: asyncio.Event = field(default_factory=asyncio.Event)
    # (client.generated_tokens, client.busy_s()) at the last GEN_RATE_WINDOW batches
    gen_marks: deque = field(default_factory=lambda: deque([(0, 0.0)], GEN_RATE_WINDOW + 1))

    def describe(self) -> str:
        """The rollout loop's state in a few words (for the watchdog's report)."""
        return (
            f"rollout loop: next batch step-{self.next_step}, servers on "
            f"v{self.version}, {self.in_flight} groups in flight, {len(self.ready)} ready"
        )


class StepSink(Protocol):
    """Where the loop reports (areal_cli.metrics.display.Sink is one)."""

    def status(self, text: str) -> None: ...

    def step(self, metrics: dict[str, float]) -> None: ...


@dataclass(frozen=True)
class ServerAddress:
    """One inference server as the loop sees it."""

    name: str  # the process name, e.g. server-0
    address: str  # http://host:port
    log: str
    served_model: str = ""  # the run's identity it must show (launch.plan.served_name)


# ---------------------------------------------------------------------------- rollouts


async def run_group(
    ctx: RolloutContext, prompt: Prompt, group_index: int, start_version: int
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

    cfg: ExperimentConfig
    run_dir: Path
    inference: InferenceClient
    tokenizer: PreTrainedTokenizerBase
    rewards: RewardPool
    workflow: Workflow
    stream: PromptStream[Prompt]
    gate: StalenessGate


def _may_launch(ctx: RolloutContext, state: LoopState) -> bool:
    """The staleness gate and the concurrency cap (see the module docstring)."""
    return ctx.gate.may_launch(state.version, state.next_step, state.in_flight, len(state.ready))


async def rollout_task(ctx: RolloutContext, state: LoopState) -> None:
    """Launch groups as the gate allows; assemble and write batches in order."""
    tasks: set[asyncio.Task] = set()
    group_index = ctx.gate.group_index(state.next_step)
    try:
        while state.next_step <= ctx.gate.total_steps:
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
            group = task.result()
            state.ready.append(group)
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
        if not ctx.gate.fresh(step, group.oldest_version):
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
    """Pack the groups into RUN/rollouts/step-K and remember their stats."""
    import torch

    from areal_cli.rundir.batch import RolloutBatch, write_batch

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
    staleness = [ctx.gate.staleness(step, g.oldest_version) for g in groups]
    generated = sum(t.n_generated for t in trajs)
    stats = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "staleness_mean": statistics.fmean(staleness),
        "staleness_max": float(max(staleness)),
        "gen_tokens": float(generated),
        "gen_tokens_per_s": gen_rate(state, ctx.inference),
        "reward_errors": float(sum(t.reward_failed for t in trajs)),
        "reward_timeouts": float(sum(t.reward_timed_out for t in trajs)),
        "dropped_stale": float(state.dropped_stale),
        "controller_wait_s": state.gate_wait_s,
    }
    state.gate_wait_s = 0.0
    t0 = time.perf_counter()
    write_batch(
        RunDir(ctx.run_dir).rollouts,
        step,
        batch,
        {"data_state": ctx.stream.state_dict(), "stats": stats},
    )
    stats["rollout_save_s"] = time.perf_counter() - t0
    state.batch_stats[step] = stats
    handoff.gc(
        RunDir(ctx.run_dir).rollouts,
        STEP_PREFIX,
        keep_last=ctx.cfg.rollout.max_staleness + 2 + ctx.cfg.recover.freq_steps,
    )


# ---------------------------------------------------------------------------- weights


async def weights_task(ctx: RolloutContext, state: LoopState, poll_s: float = 0.02) -> None:
    """Load every newly published weights/vN on all servers and check they report it.

    Woken by inotify the moment an entry is renamed into weights/; `poll_s` is only the
    fallback for filesystems that do not report renames (another node's NFS client)."""
    from areal_cli.inference.client import WeightUpdateFailed

    weights_dir = RunDir(ctx.run_dir).weights
    watcher = handoff.Watcher(weights_dir)
    try:
        while True:
            entry = handoff.newest_after(weights_dir, VERSION_PREFIX, state.version)
            if entry is not None and ctx.inference.any_up():  # else: the restart loads it
                t0 = time.perf_counter()
                async with state.weights_lock:  # a restarted server joins between loads
                    try:
                        answers = await ctx.inference.update_weights_from_disk(
                            str(entry.path), entry.version
                        )
                    except WeightUpdateFailed:
                        if entry.path.exists():
                            raise
                        continue  # the trainer replaced and collected it: load the newer one
                    if not answers:  # every server went down meanwhile: their restarts load it
                        continue
                    if not all("weight_version" in answer for answer in answers):
                        answers = await ctx.inference.model_info()  # SGLang does not say
                    reported = {str(answer.get("weight_version")) for answer in answers}
                    if reported != {str(entry.version)}:
                        raise RunFailed(
                            f"servers report weight versions {sorted(reported)} after loading v{entry.version}"
                        )
                    state.version = entry.version
                load_s = time.perf_counter() - t0
                now = time.time()
                state.handoff[entry.version] = {
                    "handoff_load_s": load_s,
                    # From the finished entry (manifest written) to every server on vN ...
                    "handoff_latency_s": now - float(entry.manifest["created"]),
                    # ... and from the moment the trainer started writing it.
                    "handoff_total_s": now
                    - float(entry.meta.get("publish_started", entry.manifest["created"])),
                }
                state.version_changed.set()
                continue  # a newer one may have landed while this one loaded
            await watcher.wait_async(poll_s)
    finally:
        watcher.close()


# ---------------------------------------------------------------------------- metrics


METRIC_KEYS = (
    "loss",
    "grad_norm",
    "clip_frac",
    "entropy",
    "imp_weight_mean",
    "imp_weight_max",
    "padding_fraction",
    "replanned_shards",
    "empty_micro_batches",
    "tokens",
    "kl",
    # algorithm: ppo (the critic; areal_cli.trainer.critic)
    "value_loss",
    "value_clip_frac",
    "explained_variance",
    "value_mean",
    "return_mean",
    "critic_grad_norm",
)


async def metrics_task(
    ctx: RolloutContext,
    state: LoopState,
    sink: StepSink,
    counters: dict[str, int],
    poll_s: float = 0.1,
) -> None:
    """Join trainer stats and rollout stats per step into metrics.jsonl and the display."""
    paths = RunDir(ctx.run_dir)
    trainer_file = paths.trainer_metrics
    done = steps_in(paths.metrics)
    pending: dict[int, dict] = {}
    offset = 0
    while True:
        lines, offset = read_new_lines(trainer_file, offset)
        for line in lines:
            record = json.loads(line)
            if record["step"] not in done:
                pending[record["step"]] = record
        # A step's line is complete once the servers loaded the weights it produced (step
        # k's are vk), or newer ones (a version can be skipped when the next lands first:
        # no load figures then)
        for step in sorted(s for s in pending if state.version >= s):
            record = pending.pop(step)
            rollout = state.batch_stats.get(step) or _stored_stats(ctx.run_dir, step)
            metrics = build_metrics(record, rollout, state.handoff.get(step, {}))
            metrics |= counters | {"requests_reissued": ctx.inference.reissued}
            with open(paths.metrics, "a") as f:
                f.write(json.dumps(metrics) + "\n")
            done.add(step)
            sink.step(metrics)
        await asyncio.sleep(poll_s)


def gen_rate(state: LoopState, client: Any) -> float:
    """gen_tokens_per_s: the tokens the servers answered over the wall time at least one
    /generate call was in flight (InferenceClient.busy_s), over the last GEN_RATE_WINDOW
    batches. Counting by the client's clocks, not by which groups happened to finish
    between two batches, keeps it steady when generation overlaps training."""
    state.gen_marks.append((client.generated_tokens, client.busy_s()))
    (tokens0, busy0), (tokens1, busy1) = state.gen_marks[0], state.gen_marks[-1]
    return (tokens1 - tokens0) / (busy1 - busy0) if busy1 > busy0 else 0.0


def _stored_stats(run_dir: Path, step: int) -> dict:
    """A step's rollout figures from its batch entry: after a restart, for a step whose
    batch an earlier controller wrote but whose line it never did."""
    try:
        return dict(handoff.read_entry(RunDir(run_dir).rollout(step)).meta["stats"])
    except (handoff.IncompleteEntry, KeyError):
        return {}


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


def steps_in(path: Path) -> set[int]:
    if not path.exists():
        return set()
    return {json.loads(line)["step"] for line in path.read_text().splitlines() if line}


def read_new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines appended to `path` since `offset`."""
    if not path.exists():
        return [], offset
    with open(path) as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind("\n") + 1]
    return [line for line in complete.splitlines() if line], offset + len(complete.encode())


# ---------------------------------------------------------------------------- the run


async def run_loop(
    loaded: LoadedConfig,
    run_dir: Path,
    servers: list[ServerAddress],
    start_step: int,
    sink: StepSink,
    prompts: list[Prompt],
    tokenizer: PreTrainedTokenizerBase,
    *,
    check_children: Callable[[], None],
    until_trainer_done: Callable[[ServerRecovery], Awaitable[None]],
    guards: Callable[[InferenceClient, LoopState], list[Awaitable[None]]],
    counters: dict[str, int] | None = None,
) -> None:
    """Wait for the servers, then run the three tasks until `until_trainer_done()` returns.

    `check_children` raises when a process died (called while the servers start);
    `guards(client, state)` run beside the tasks, and any of them raising stops the loop;
    `counters` (restarts so far) go into every metrics line; `until_trainer_done` gets
    the loop's ServerRecovery, to bring a restarted server back."""
    from areal_cli.config.allocation import parse_allocation
    from areal_cli.data.prompts import PromptStream
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.rewards import RewardPool

    cfg = loaded.config
    client = InferenceClient(
        [s.address for s in servers],
        api_key=cfg.inference.api_key,
        timeout_s=cfg.rollout.request_timeout_s,
        retries=cfg.rollout.request_retries,
        logs={s.address: s.log for s in servers},
        backend=parse_allocation(cfg.allocation_mode).inference_backend,
        served_model=servers[0].served_model,
    )
    rewards = RewardPool.from_config(cfg.reward, loaded.recipe.resolve().parent)
    try:
        sink.status("waiting for inference servers")
        await client.wait_healthy(
            cfg.launcher.startup_timeout_s, on_poll=lambda _: check_children()
        )
        stream = PromptStream.from_config(prompts, cfg.dataset)
        _restore_stream(stream, run_dir, start_step)
        workflow = resolve_workflow(
            cfg.rollout.workflow, loaded.recipe.resolve().parent, cfg.rollout.max_turns
        )
        gate = StalenessGate.from_config(cfg)
        ctx = RolloutContext(cfg, run_dir, client, tokenizer, rewards, workflow, stream, gate)
        state = LoopState(version=0 if start_step == 1 else -1, next_step=start_step)
        sink.status(f"training ({len(prompts)} prompts)")
        tasks = [
            asyncio.create_task(rollout_task(ctx, state)),
            asyncio.create_task(weights_task(ctx, state)),
            asyncio.create_task(metrics_task(ctx, state, sink, counters or {})),
            *(asyncio.ensure_future(guard) for guard in guards(client, state)),
        ]
        recovery = ServerRecovery(ctx, state, cfg.launcher.startup_timeout_s)
        done_task = asyncio.ensure_future(until_trainer_done(recovery))
        try:
            while not done_task.done():
                done, _ = await asyncio.wait(
                    [done_task, *tasks], return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if task is not done_task and task.exception() is not None:
                        raise task.exception()
                tasks = [t for t in tasks if not t.done()]
            done_task.result()
            await asyncio.sleep(0.3)  # let the metrics task read the trainer's last line
            lines, _ = read_new_lines(RunDir(run_dir).trainer_metrics, 0)
            await _drain_metrics(ctx, state, sink, len(lines))
        finally:
            for task in [*tasks, done_task]:
                task.cancel()
            await asyncio.gather(*tasks, done_task, return_exceptions=True)
    finally:
        rewards.close()
        await client.close()


async def _drain_metrics(
    ctx: RolloutContext, state: LoopState, sink: StepSink, expected: int, timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while len(steps_in(RunDir(ctx.run_dir).metrics)) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def _restore_stream(stream: PromptStream[Prompt], run_dir: Path, start_step: int) -> None:
    """The dataset position after batch start_step-1, saved with it (a resumed run)."""
    if start_step == 1:
        return
    entry = handoff.latest(RunDir(run_dir).rollouts, STEP_PREFIX)
    if entry is not None and entry.version == start_step - 1 and "data_state" in entry.meta:
        stream.load_state_dict(entry.meta["data_state"])
