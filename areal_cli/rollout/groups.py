"""The rollouts task of the loop: start groups of episodes as the staleness gate allows, and
write each batch (areal_cli.rollout.batch) as soon as enough fresh groups are ready.

A group is `group_size` episodes of one prompt, run concurrently, each with its own
sampling seed, drawn from the run's seed and the group's index, so a resumed run draws
what an unbroken run would have drawn: each batch saves the index of the next group to
start beside the dataset position (areal_cli.rollout.batch.restore_stream).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from areal_cli.rollout.batch import assemble_batch
from areal_cli.rollout.state import Group, LoopState, RolloutContext
from areal_cli.rollout.workflows import EpisodeClient, Trajectory

if TYPE_CHECKING:
    from areal_cli.data.prompts import Prompt


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
    group = Group([], start_version, prompt.index)
    for outcome in await asyncio.gather(*episodes):
        if isinstance(outcome, Trajectory):
            group.trajectories.append(outcome)
        else:  # an agent episode's EpisodeOutcome
            group.trajectories += outcome.trajectories
            for key, value in outcome.counters.items():
                group.counters[key] = group.counters.get(key, 0.0) + value
    return group


async def rollout_task(ctx: RolloutContext, state: LoopState) -> None:
    """Launch groups as the gate allows; assemble and write batches in order."""
    tasks: set[asyncio.Task[Group]] = set()
    try:
        while state.next_step <= ctx.gate.total_steps:
            while ctx.gate.may_launch(
                state.version, state.next_step, state.in_flight, len(state.ready)
            ):
                if ctx.online is not None:  # outside sessions fill it (rollout.online)
                    launch = ctx.online.group(state.next_group, state.version)
                else:
                    prompt = ctx.stream.next_batch(1)[0]
                    launch = run_group(ctx, prompt, state.next_group, state.version)
                task = asyncio.create_task(launch)
                state.next_group += 1
                state.in_flight += 1
                tasks.add(task)
                task.add_done_callback(lambda t, s=state: _on_group_done(t, s, tasks))
            if await assemble_batch(ctx, state) or ctx.gate.may_launch(
                state.version, state.next_step, state.in_flight, len(state.ready)
            ):  # a batch was written, or groups were dropped: room to launch again
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


def _on_group_done(
    task: asyncio.Task[Group], state: LoopState, tasks: set[asyncio.Task[Group]]
) -> None:
    tasks.discard(task)
    state.in_flight -= 1
    if not task.cancelled():
        error = task.exception()
        state.ready.append(error if error is not None else task.result())
    state.group_done.set()


async def _wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
