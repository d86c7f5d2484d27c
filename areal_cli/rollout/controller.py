"""The controller's rollout loop: what `areal train` runs once its processes are up.

launch/train.py prepares the run directory, starts the servers and the trainer, and then
runs `run_loop` with hooks of its own (`LoopHooks`): one that returns when the trainer has
finished (and raises when a child died), and guards that run beside the loop (the
watchdog).

Loop (asyncio), three tasks, each a part of its own:
  rollouts  draw prompts, run `group_size` episodes each, score them, and write trainer
            batches RUN/rollouts/step-N (areal_cli.rollout.groups, .batch);
  weights   when the trainer publishes RUN/weights/vN, load it on every server and check
            each reports vN (areal_cli.rollout.sync);
  metrics   when the trainer finishes step N, join its record with the rollout figures of
            batch N into one line of RUN/metrics.jsonl and the display
            (areal_cli.rollout.metrics).

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
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from areal_cli.config.loader import LoadedConfig
from areal_cli.config.recipe_code import load_agent
from areal_cli.config.resolve import is_loopback
from areal_cli.config.schema import ExperimentConfig
from areal_cli.rollout.agents import AgentRunner
from areal_cli.rollout.batch import restore_stream, stored_stats
from areal_cli.rollout.evaluation import Evaluator, eval_task, make_evaluator
from areal_cli.rollout.gate import StalenessGate
from areal_cli.rollout.groups import rollout_task
from areal_cli.rollout.metrics import MetricsJoin, metrics_task, read_new_lines, steps_in
from areal_cli.rollout.online import NoPrompts, OnlineSessions, SessionSettings
from areal_cli.rollout.phases import Phases, ServerTurn
from areal_cli.rollout.proxy import AgentProxy, ProxySettings
from areal_cli.rollout.recovery import ServerRecovery
from areal_cli.rollout.state import LoopState, RolloutContext, StepSink
from areal_cli.rollout.sync import GroupPlan, GroupSync, WeightSync
from areal_cli.rollout.workflows import resolve_workflow
from areal_cli.rundir.handoff import write_json_atomic
from areal_cli.rundir.paths import RunDir
from areal_cli.rundir.weight_group import GroupSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from areal_cli.data.prompts import Prompt
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.rewards import RewardPool


@dataclass(frozen=True)
class ServerAddress:
    """One inference server as the loop sees it."""

    name: str  # the process name, e.g. server-0
    address: str  # http://host:port
    log: str
    served_model: str = ""  # the run's identity it must show (launch.plan.served_name)
    group_rank: int = 0  # its first rank in the weight-update group (method distributed)


@dataclass(frozen=True)
class RolloutData:
    """The loop's prompts and the tokenizer that made them."""

    prompts: list[Prompt]
    tokenizer: PreTrainedTokenizerBase
    eval_prompts: list[Prompt] = field(default_factory=list)  # for eval.freq_steps
    context_length: int = 0  # the model's (the agent proxy's limit); 0: not known


class ChildCheck(Protocol):
    """Raises when a process of the run died (called while the servers start)."""

    def __call__(self) -> None: ...


class TrainerDone(Protocol):
    """Returns when the trainer has exited cleanly; raises when a child died. Gets the
    loop's ServerRecovery, to bring a restarted server back."""

    def __call__(self, recovery: ServerRecovery) -> Awaitable[None]: ...


class Guards(Protocol):
    """Tasks that run beside the loop (the watchdog); any of them raising stops it."""

    def __call__(self, client: InferenceClient, state: LoopState) -> list[Awaitable[Any]]: ...


@dataclass(frozen=True)
class LoopHooks:
    """What the launch layer hands to the loop."""

    check_children: ChildCheck
    until_trainer_done: TrainerDone
    guards: Guards
    counters: Mapping[str, int] = field(default_factory=dict)  # restarts, in every line


async def run_loop(
    loaded: LoadedConfig,
    run_dir: Path,
    servers: list[ServerAddress],
    start_step: int,
    sink: StepSink,
    data: RolloutData,
    *,
    backend: str,
    hooks: LoopHooks,
    weight_group: GroupSpec | None = None,
    colocated: ServerTurn | None = None,
) -> None:
    """Wait for the servers (of inference backend `backend`), then run the three tasks
    until `hooks.until_trainer_done` returns. `weight_group`: the servers receive weights
    over this group (method distributed) instead of loading them from disk. `colocated`:
    the servers share the trainer's devices and the two take turns (rollout.phases); the
    servers' turn, which the caller keeps across loops (None: not colocated)."""
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.rewards import RewardPool

    cfg = loaded.config
    client = InferenceClient(
        [s.address for s in servers],
        api_key=cfg.inference.api_key,
        timeout_s=cfg.rollout.request_timeout_s,
        retries=cfg.rollout.request_retries,
        logs={s.address: s.log for s in servers},
        backend=backend,
        served_model=servers[0].served_model,
        lora_name=cfg.gconfig.lora_name or cfg.experiment_name,
    )
    rewards = RewardPool.from_config(cfg.reward, loaded.recipe.resolve().parent)
    try:
        sink.status("waiting for inference servers")
        await client.wait_healthy(
            cfg.launcher.startup_timeout_s, on_poll=lambda _: hooks.check_children()
        )
        proxy = await _start_proxy(cfg, client, data, servers[0].served_model, run_dir)
        online = proxy.sessions if proxy is not None else None
        agents = None
        if proxy is not None and online is None:
            agents = await _agent_runner(loaded, proxy)
        ctx = _context(loaded, run_dir, client, rewards, data, agents, colocated, online)
        state = LoopState(version=0 if start_step == 1 else -1, next_step=start_step)
        state.episodes = agents or online  # the watchdog's report names a stuck agent
        if online is not None:
            online.version = lambda: state.version
        restored = restore_stream(ctx.stream, run_dir, start_step)
        state.next_group = ctx.gate.group_index(start_step) if restored is None else restored
        if online is not None:
            sink.status(f"training on online sessions: POST {proxy.address}/rl/start_session")
        else:
            sink.status(f"training ({len(data.prompts)} prompts)")
        if ctx.phases is not None:
            await ctx.phases.begin()  # servers an earlier loop left released stay shut
        evaluator = make_evaluator(
            cfg, run_dir, client, data.tokenizer, data.eval_prompts, loaded.recipe.resolve().parent
        )
        try:
            group = None
            if weight_group is not None:
                group = GroupPlan(weight_group, {s.address: s.group_rank for s in servers})
            await _run_tasks(ctx, state, sink, hooks, evaluator, group)
        finally:
            if evaluator is not None:
                await evaluator.close()
            if agents is not None and agents.pool is not None:
                await agents.pool.close()
            if proxy is not None:
                await proxy.close()
            if online is not None:
                _online_summary(online, state, run_dir, sink)
            if ctx.phases is not None:
                ctx.phases.close()
    finally:
        rewards.close()
        await client.close()


def _online_summary(
    online: OnlineSessions, state: LoopState, run_dir: Path, sink: StepSink
) -> None:
    """Where every online session went, in RUN/online.json and one line: the steps'
    figures count those whose groups reached a batch; the rest are accounted here."""
    counted = sum(stats.get("online_sessions", 0.0) for stats in state.batch_stats.values())
    summary = online.summary(int(counted))
    RunDir(run_dir).proxy.unlink(missing_ok=True)  # its address is closed now
    write_json_atomic(RunDir(run_dir).online, summary)
    sink.status(
        f"online: {summary['started']} sessions started: {summary['ended']} ended, "
        f"{summary['timed_out']} timed out, {summary['open_at_end']} open at the end; "
        f"{summary['counted_in_steps']} counted in the steps' figures, "
        f"{summary['after_last_batch']} came after the last batch"
    )


async def _start_proxy(
    cfg: ExperimentConfig, client: InferenceClient, data: RolloutData, served: str, run_dir: Path
) -> AgentProxy | None:
    """The agent proxy in front of the servers, when the recipe names an agent or runs
    online (with its session routes; its address then goes into RUN/proxy.json, for the
    outside clients)."""
    if not cfg.rollout.agent and cfg.rollout.mode != "online":
        return None
    from areal_cli.data.chat import resolve_tool_parser

    settings = ProxySettings(
        host=cfg.rollout.proxy.host,
        port=cfg.rollout.proxy.port,
        api_key="" if is_loopback(cfg.rollout.proxy.host) else cfg.inference.api_key,
        served_model=served or "areal",
        context_length=data.context_length or 4096,
        tool_parser=resolve_tool_parser(cfg.rollout.tool_parser, data.tokenizer),
    )
    proxy = AgentProxy(
        settings,
        data.tokenizer,
        lambda ids, params: client.generate(ids, params, return_logprob=True),
        cfg.gconfig.sampling_params(),
    )
    if cfg.rollout.mode == "online":
        OnlineSessions(proxy, SessionSettings.from_config(cfg), version=lambda: -1)
    await proxy.start()
    if proxy.sessions is not None:
        write_json_atomic(RunDir(run_dir).proxy, proxy.sessions.card())
    return proxy


async def _agent_runner(loaded: LoadedConfig, proxy: AgentProxy) -> AgentRunner:
    """The agent's episodes; with rollout.mode subproc, its worker processes started."""
    r = loaded.config.rollout
    recipe_dir = loaded.recipe.resolve().parent
    pool = None
    if r.mode == "subproc":
        from areal_cli.rollout.subproc import AgentPool

        pool = AgentPool(r.agent, recipe_dir, r.subproc_max_workers)
        await pool.start()
    return AgentRunner(
        proxy, load_agent(r.agent, recipe_dir, sync_ok=pool is not None), r.agent_samples,
        r.turn_discount, r.agent_timeout_s, name=r.agent, pool=pool,
    )  # fmt: skip


def _context(
    loaded: LoadedConfig,
    run_dir: Path,
    client: InferenceClient,
    rewards: RewardPool,
    data: RolloutData,
    agents: AgentRunner | None = None,
    colocated: ServerTurn | None = None,
    online: OnlineSessions | None = None,
) -> RolloutContext:
    """The loop's long-lived objects (the prompt stream from its start: run_loop restores
    a resumed run's position); with an agent, its episodes are the workflow; online, the
    outside sessions fill the groups and no prompt is drawn."""
    from areal_cli.data.prompts import PromptStream

    cfg = loaded.config
    recipe_dir = loaded.recipe.resolve().parent
    stream: Any = NoPrompts() if online is not None else None
    if stream is None:
        stream = PromptStream.from_config(data.prompts, cfg.dataset)
    if agents is not None:
        workflow = agents.episode
    elif online is not None:
        workflow = online.no_workflow
    else:
        workflow = resolve_workflow(cfg.rollout.workflow, recipe_dir, cfg.rollout.max_turns)
    gate = StalenessGate.from_config(cfg)
    phases = Phases.for_run(client, run_dir, colocated) if colocated is not None else None
    return RolloutContext(
        cfg, run_dir, client, data.tokenizer, rewards, workflow, stream, gate, phases, online
    )


def _limits(cfg: Any) -> dict[str, float]:
    """The time limits that a step's warnings name, by key."""
    r = cfg.rollout
    return {
        "rollout.agent_timeout_s": r.agent_timeout_s,
        "rollout.session_timeout_s": r.session_timeout_s,
    }


async def _run_tasks(
    ctx: RolloutContext,
    state: LoopState,
    sink: StepSink,
    hooks: LoopHooks,
    evaluator: Evaluator | None,
    group: GroupPlan | None = None,
) -> None:
    """The loop's tasks and guards until the trainer is done; then the last lines."""
    weights = RunDir(ctx.run_dir).weights
    timeout_s = ctx.cfg.launcher.startup_timeout_s
    sync = (
        WeightSync(ctx.inference, weights, state, ctx.phases)
        if group is None
        else GroupSync(ctx.inference, weights, state, group, timeout_s)
    )
    join = MetricsJoin(
        ctx.run_dir,
        lambda step: state.batch_stats.get(step) or stored_stats(ctx.run_dir, step),
        lambda: {**hooks.counters, "requests_reissued": ctx.inference.reissued},
    )
    tasks = [
        *([asyncio.create_task(eval_task(evaluator, state, sink))] if evaluator else []),
        *([asyncio.create_task(ctx.online.watch())] if ctx.online is not None else []),
        asyncio.create_task(rollout_task(ctx, state)),
        asyncio.create_task(sync.run()),
        asyncio.create_task(
            metrics_task(join, lambda: state.version, state.handoff, sink, _limits(ctx.cfg))
        ),
        *(asyncio.ensure_future(guard) for guard in hooks.guards(ctx.inference, state)),
    ]
    recovery = ServerRecovery(ctx.inference, weights, state, timeout_s, sync)
    done_task = asyncio.ensure_future(hooks.until_trainer_done(recovery))
    try:
        await _until(done_task, tasks)
        done_task.result()
        await asyncio.sleep(0.3)  # let the metrics task read the trainer's last line
        lines, _ = read_new_lines(RunDir(ctx.run_dir).trainer_metrics, 0)
        await _drain_metrics(ctx.run_dir, len(lines))
        if evaluator is not None:  # the last version's evaluation, when it is due
            settled = asyncio.ensure_future(evaluator.settled(state))
            tasks.append(settled)
            await _until(settled, tasks)
    finally:
        for task in [*tasks, done_task]:
            task.cancel()
        await asyncio.gather(*tasks, done_task, return_exceptions=True)


async def _until(target: asyncio.Future, tasks: list[asyncio.Future]) -> None:
    """Wait until `target` is done; the first of the other `tasks` that fails meanwhile
    raises its error (one that ends without error is let go)."""
    others = [t for t in tasks if t is not target]
    while not target.done():
        done, _ = await asyncio.wait([target, *others], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            error = None if task is target else task.exception()
            if error is not None:
                raise error
        others = [t for t in others if not t.done()]


async def _drain_metrics(run_dir: Path, expected: int, timeout_s: float = 30.0) -> None:
    """Wait (at most `timeout_s`) until metrics.jsonl has `expected` steps."""
    deadline = time.monotonic() + timeout_s
    while len(steps_in(RunDir(run_dir).metrics)) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
