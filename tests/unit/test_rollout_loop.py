"""The rollouts task of the loop (areal_cli.rollout.groups with the gate and the batch
writer), in-process: a workflow that records the weight version the servers hold while
it runs, real batches written to a real RUN/rollouts/, and a trainer that takes each
batch and moves the servers' version as the weight sync would."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from areal_cli.config.schema import ExperimentConfig
from areal_cli.data.prompts import Prompt, PromptStream
from areal_cli.inference.client import InferenceClient
from areal_cli.rollout.batch import restore_stream
from areal_cli.rollout.gate import StalenessGate
from areal_cli.rollout.groups import rollout_task
from areal_cli.rollout.state import LoopState, RolloutContext
from areal_cli.rollout.workflows import EpisodeClient, Trajectory
from areal_cli.rundir import handoff
from areal_cli.rundir.paths import STEP_PREFIX, RunDir

PROMPTS = [Prompt(i, [10 + i, 11], str(i), {"i": i}) for i in range(50)]


class Servers:
    """The version the servers hold, and which episodes run on it: `slow` prompts finish
    only once the servers hold `slow_until` (their tokens stay from the version they
    started on), and episodes started on that version finish after the slow ones were
    dropped, so that the step they are dropped at does not hang on timing."""

    def __init__(self, state: LoopState, slow: set[int], slow_until: int) -> None:
        self.state, self.slow, self.slow_until = state, slow, slow_until
        self.drawn: list[tuple[int, int]] = []  # (prompt index, sampling seed) per episode

    async def episode(self, client: EpisodeClient, sample: dict) -> Trajectory:
        version = self.state.version
        self.drawn.append((sample["index"], client.sampling_params()["sampling_seed"]))
        if sample["index"] in self.slow:
            while self.state.version < self.slow_until:
                await asyncio.sleep(0.001)
        elif self.slow and version >= self.slow_until:  # after the slow group came back
            while not self.state.dropped_stale:  # (hangs, and times out, if never dropped)
                await asyncio.sleep(0.001)
        await asyncio.sleep(0)
        return Trajectory(
            input_ids=[*sample["prompt_ids"], 1, 2],
            loss_mask=[0, 0, 1, 1],
            logprobs=[0.0, 0.0, -0.5, -0.5],
            versions=[-1, -1, version, version],
            reward=self.reward(sample["index"], client.sampling_params()["sampling_seed"]),
        )

    def reward(self, prompt: int, seed: int) -> float:
        return 1.0


class SolvedOddPrompts(Servers):
    """Every episode of an odd prompt scores 1 (a group of equal rewards); an even prompt's
    episodes score by their seed."""

    def reward(self, prompt: int, seed: int) -> float:
        return 1.0 if prompt % 2 else float(seed % 2)


def _context(tmp_path: Path, max_staleness: int, steps: int, servers_for, **rollout_keys) -> tuple:
    cfg = ExperimentConfig()
    cfg = dataclasses.replace(
        cfg,
        total_train_steps=steps,
        rollout=dataclasses.replace(
            cfg.rollout, batch_size=2, group_size=2, max_staleness=max_staleness, **rollout_keys
        ),
    )
    stream = PromptStream(PROMPTS, seed=1)
    client = InferenceClient(["http://127.0.0.1:9"])  # never called: the workflow is ours
    state = LoopState(version=0, next_step=1)
    servers = servers_for(state)
    gate = StalenessGate.from_config(cfg)
    ctx = RolloutContext(cfg, tmp_path, client, None, None, servers.episode, stream, gate)
    return ctx, state, servers


async def _train(state: LoopState, steps: int) -> list[int]:
    """Take batch k once written, then publish vk; returns the version each batch saw."""
    seen = []
    for step in range(state.next_step, steps + 1):
        while state.next_step <= step:
            await asyncio.sleep(0.001)
        seen.append(state.version)
        await asyncio.sleep(0.005)  # the step trains while rollouts go on
        state.version = step
        state.version_changed.set()
    return seen


def _run(ctx: RolloutContext, state: LoopState, steps: int) -> None:
    async def both() -> None:
        await asyncio.wait_for(asyncio.gather(rollout_task(ctx, state), _train(state, steps)), 20)

    asyncio.run(both())


def _written(state: LoopState, run_dir: Path) -> list[dict]:
    """The figures of every batch written, in step order; the newest batches are on disk
    (older ones collected), with the same figures."""
    on_disk = handoff.list_entries(RunDir(run_dir).rollouts, STEP_PREFIX)
    assert on_disk
    for entry in on_disk:  # all but the save time, measured after the write
        kept = dict(state.batch_stats[entry.version])
        del kept["rollout_save_s"]
        assert entry.meta["stats"] == kept
    return [state.batch_stats[k] for k in sorted(state.batch_stats)]


@pytest.mark.parametrize("max_staleness", [0, 1, 4])
def test_every_batch_is_within_max_staleness(tmp_path: Path, max_staleness: int) -> None:
    ctx, state, _ = _context(tmp_path, max_staleness, 5, lambda s: Servers(s, set(), 0))
    _run(ctx, state, 5)
    stats = _written(state, tmp_path)
    assert len(stats) == 5 and state.next_step == 6
    staleness = [s["staleness_max"] for s in stats]
    assert max(staleness) <= max_staleness
    # Version 0 feeds the first max_staleness + 1 batches (the run has 5): started together
    assert staleness[: min(max_staleness + 1, 5)] == list(range(min(max_staleness + 1, 5)))
    assert all(s["dropped_stale"] == 0 and s["reward_mean"] == 1.0 for s in stats)


def test_a_group_that_finishes_too_late_is_dropped_not_trained(tmp_path: Path) -> None:
    first = PromptStream(PROMPTS, seed=1).next_batch(1)[0].index  # the first group's prompt
    ctx, state, _ = _context(tmp_path, 1, 4, lambda s: Servers(s, {first}, slow_until=2))
    _run(ctx, state, 4)
    stats = _written(state, tmp_path)
    # the first group started on v0 and finished once the servers held v2: too old for
    # step 3 (which trains v2: 2 versions behind, max 1), so dropped, and counted from then
    assert [s["dropped_stale"] for s in stats] == [0.0, 0.0, 1.0, 1.0]
    assert max(s["staleness_max"] for s in stats) <= 1


def test_a_resumed_loop_draws_what_the_unbroken_run_drew(tmp_path: Path) -> None:
    no_slow = lambda s: Servers(s, set(), 0)  # noqa: E731
    ctx, state, unbroken = _context(tmp_path / "unbroken", 0, 4, no_slow)
    _run(ctx, state, 4)
    ctx, state, before = _context(tmp_path / "resumed", 0, 2, no_slow)
    _run(ctx, state, 2)  # the run dies after step 2 (recover/step-2)
    ctx, state, after = _context(tmp_path / "resumed", 0, 4, no_slow)
    state.next_group = restore_stream(ctx.stream, ctx.run_dir, start_step=3)
    state.version, state.next_step = 2, 3  # the trainer republished v2
    _run(ctx, state, 4)
    assert before.drawn + after.drawn == unbroken.drawn  # the same prompts and seeds
    assert len(after.drawn) == 2 * 2 * 2  # steps 3 and 4: two groups of two episodes


def test_a_resumed_asynchronous_loop_seeds_each_prompt_as_the_unbroken_run_did(
    tmp_path: Path,
) -> None:
    """With max_staleness 2, groups for step 3 were started when batch 2 was written; they
    are lost with the process, and the resumed run starts at the next prompt with the
    seeds the unbroken run gave it (the batch saves the next group's index)."""
    import shutil

    no_slow = lambda s: Servers(s, set(), 0)  # noqa: E731
    ctx, state, unbroken = _context(tmp_path / "unbroken", 2, 5, no_slow)
    _run(ctx, state, 5)
    died = tmp_path / "died"
    (died / "rollouts").mkdir(parents=True)
    # the run died after step 2: its last batch (the unbroken run's, kept by its GC)
    shutil.copytree(RunDir(tmp_path / "unbroken").rollout(2), RunDir(died).rollout(2))
    ctx, state, after = _context(died, 2, 5, no_slow)
    state.next_group = restore_stream(ctx.stream, died, start_step=3)
    assert state.next_group > 2 * 2  # step 3's groups had started
    state.version, state.next_step = 2, 3
    _run(ctx, state, 5)
    # groups 6-9 are the unbroken run's last four (the same prompts and seeds); it drew
    # 10 groups in all, and the resumed run draws two more to fill its three batches
    assert len(after.drawn) == 3 * 2 * 2
    assert len(set(after.drawn) & set(unbroken.drawn)) == 4 * 2


@pytest.mark.parametrize("dynamic_bs", [False, True])
def test_dynamic_sampling_trains_only_groups_with_a_spread(
    tmp_path: Path, dynamic_bs: bool
) -> None:
    ctx, state, servers = _context(
        tmp_path, 1, 4, lambda s: SolvedOddPrompts(s, set(), 0),
        dynamic_sampling=True, dynamic_bs=dynamic_bs,
    )  # fmt: skip
    _run(ctx, state, 4)
    stats = _written(state, tmp_path)
    from areal_cli.rundir.batch import read_batch

    for entry in handoff.list_entries(RunDir(tmp_path).rollouts, STEP_PREFIX):
        rewards = read_batch(entry).rewards.view(-1, 2)
        assert all(row[0] != row[1] for row in rewards.tolist())  # every group has a spread
    dropped = sum(s["dropped_uniform"] for s in stats)
    assert dropped > 0 and len({i for i, _ in servers.drawn}) == len(servers.drawn) // 2
    sizes = [s["batch_groups"] for s in stats]
    assert sizes == [2.0] * 4 if not dynamic_bs else all(1 <= n <= 2 for n in sizes)


def test_the_dataset_position_is_restored_from_the_last_batch(tmp_path: Path) -> None:
    ctx, state, _ = _context(tmp_path, 0, 3, lambda s: Servers(s, set(), 0))
    _run(ctx, state, 3)
    unbroken = ctx.stream.next_batch(3)
    again = PromptStream(PROMPTS, seed=1)
    restore_stream(again, tmp_path, start_step=4)
    assert again.next_batch(3) == unbroken
