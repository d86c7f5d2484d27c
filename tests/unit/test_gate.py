"""The staleness gate (areal_cli.rollout.gate) and the batch assembly of the rollout loop,
without processes: steps count from 1, and step k trains the weights of version k-1."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_cli.rollout.batch import DynamicSampling, restore_stream, rollout_figures, take_fresh
from areal_cli.rollout.gate import StalenessGate
from areal_cli.rollout.state import Group, LoopState
from areal_cli.rollout.workflows import Trajectory


def launched_before_blocked(gate: StalenessGate, version: int, next_step: int) -> int:
    """How many groups the gate lets start, with none finishing meanwhile."""
    n = 0
    while gate.may_launch(version, next_step, in_flight=n, ready=0):
        n += 1
        assert n < 1000
    return n


@pytest.mark.parametrize(
    ("max_staleness", "expected"),
    [(0, 2), (1, 4), (4, 6)],  # 4: capped by the run's 3 steps, not by staleness
)
def test_version_0_feeds_the_first_max_staleness_plus_1_batches(max_staleness, expected) -> None:
    gate = StalenessGate(batch_size=2, max_staleness=max_staleness, total_steps=3)
    assert launched_before_blocked(gate, version=0, next_step=1) == expected


def test_synchronous_rl_waits_for_the_weights_of_the_previous_step() -> None:
    gate = StalenessGate(batch_size=2, max_staleness=0, total_steps=5)
    # batch 1 written from v0; the servers still hold v0: nothing may start for step 2
    assert launched_before_blocked(gate, version=0, next_step=2) == 0
    assert launched_before_blocked(gate, version=1, next_step=2) == 2
    assert gate.fresh(step=2, version=1) and not gate.fresh(step=2, version=0)


def test_the_concurrency_cap_holds_even_when_staleness_allows_more() -> None:
    gate = StalenessGate(batch_size=2, max_staleness=4, total_steps=100, max_concurrent=3)
    assert launched_before_blocked(gate, version=0, next_step=1) == 3
    # groups that finished and wait for their batch count against staleness, not the cap
    assert gate.may_launch(0, 1, in_flight=2, ready=7)
    assert not gate.may_launch(0, 1, in_flight=2, ready=8)  # 10 = 5 usable batches of 2


def test_an_unknown_version_after_a_resume_launches_nothing() -> None:
    gate = StalenessGate(batch_size=2, max_staleness=1, total_steps=5)
    assert not gate.may_launch(-1, 3, in_flight=0, ready=0)


def test_staleness_is_counted_against_the_weights_the_trainer_holds() -> None:
    gate = StalenessGate(batch_size=1, max_staleness=1, total_steps=10)
    assert gate.staleness(step=1, version=0) == 0  # step 1 trains v0 on v0's samples
    assert gate.staleness(step=5, version=3) == 1
    assert gate.fresh(step=5, version=3) and not gate.fresh(step=5, version=2)


def test_the_resume_position_draws_what_an_unbroken_run_draws() -> None:
    gate = StalenessGate(batch_size=3, max_staleness=1, total_steps=10)
    assert gate.group_index(1) == 0
    assert gate.group_index(5) == 12  # four batches of three groups came before step 5


def _group(*versions: int, start: int) -> Group:
    trajectories = [Trajectory(versions=[-1, v, v], loss_mask=[0, 1, 1]) for v in versions]
    return Group(trajectories, start_version=start, prompt_index=0)


def _gate(max_staleness: int, batch_size: int = 2) -> StalenessGate:
    return StalenessGate(batch_size=batch_size, max_staleness=max_staleness, total_steps=10)


def test_a_group_with_one_stale_episode_is_dropped_whole_and_counted() -> None:
    state = LoopState(version=3, next_step=4)
    # a partial group: one episode resumed on v3, one still carries v1's tokens
    state.ready = deque([_group(3, 1, start=3), _group(3, 3, start=3)])
    assert take_fresh(_gate(max_staleness=1), state, batch_size=2) is None  # 1 is not 2
    assert state.dropped_stale == 1
    assert len(state.ready) == 1 and state.next_step == 4


def test_a_group_started_on_old_weights_is_stale_even_if_its_tokens_are_new() -> None:
    state = LoopState(version=3, next_step=4)
    started_on_v1, started_on_v2 = _group(3, start=1), _group(3, start=2)
    state.ready = deque([started_on_v1, started_on_v2])
    assert take_fresh(_gate(max_staleness=1), state, batch_size=1) == [started_on_v2]
    assert state.dropped_stale == 1 and not state.ready


def test_fresh_groups_beyond_the_batch_wait_for_the_next_one_in_order() -> None:
    state = LoopState(version=0, next_step=1)
    groups = [_group(0, start=0) for _ in range(5)]
    for g, index in zip(groups, range(5), strict=True):
        g.prompt_index = index
    state.ready = deque(groups)
    assert take_fresh(_gate(max_staleness=4), state, batch_size=2) == groups[:2]
    assert list(state.ready) == groups[2:] and state.dropped_stale == 0


def test_a_failed_rollout_stops_the_loop_by_name() -> None:
    from areal_cli.rollout.errors import RunFailed

    state = LoopState(version=0, next_step=1)
    state.ready = deque([ValueError("reward worker crashed")])
    with pytest.raises(RunFailed, match="a rollout failed: reward worker crashed"):
        take_fresh(_gate(max_staleness=0), state, batch_size=2)


def test_a_resumed_loop_takes_the_dataset_position_saved_with_the_last_batch(tmp_path) -> None:
    import torch

    from areal_cli.rundir.batch import RolloutBatch, write_batch

    batch = RolloutBatch(
        input_ids=torch.zeros(4, dtype=torch.int64),
        loss_mask=torch.ones(4, dtype=torch.int8),
        logprobs=torch.zeros(4),
        versions=torch.zeros(4, dtype=torch.int32),
        seqlens=torch.tensor([4]),
        rewards=torch.tensor([1.0]),
        group_size=1,
    )
    for step in (1, 2):
        write_batch(tmp_path / "rollouts", step, batch, {"data_state": {"position": 10 * step}})
    loaded = []
    stream = SimpleNamespace(load_state_dict=loaded.append)
    restore_stream(stream, Path(tmp_path), start_step=3)  # recover/step-2: go on at 3
    assert loaded == [{"position": 20}]
    restore_stream(stream, Path(tmp_path), start_step=1)  # a fresh start restores nothing
    assert loaded == [{"position": 20}]


def _rewarded(*rewards: float, start: int = 0) -> Group:
    """A fresh group (all tokens of `start`) whose episodes got `rewards`."""
    trajectories = [Trajectory(versions=[-1, start], loss_mask=[0, 1], reward=r) for r in rewards]
    return Group(trajectories, start_version=start, prompt_index=0)


def test_dynamic_sampling_refills_the_batch_past_groups_of_equal_rewards() -> None:
    sampling = DynamicSampling(enabled=True)
    state = LoopState(version=0, next_step=1)
    spread, same, zeros = _rewarded(0.0, 1.0), _rewarded(1.0, 1.0), _rewarded(0.0, 0.0)
    state.ready = deque([same, spread, zeros])
    assert take_fresh(_gate(max_staleness=0), state, 2, sampling) is None  # 1 kept of 2
    assert state.dropped_uniform == [same, zeros]
    assert list(state.ready) == [spread]
    other = _rewarded(0.5, 0.0)
    state.ready.append(other)  # the refill
    assert take_fresh(_gate(max_staleness=0), state, 2, sampling) == [spread, other]
    # off, the same groups all train
    state = LoopState(version=0, next_step=1)
    state.ready = deque([same, spread])
    assert take_fresh(_gate(max_staleness=0), state, 2) == [same, spread]
    assert state.dropped_uniform == []


def test_dynamic_bs_writes_the_kept_groups_once_batch_size_groups_finished() -> None:
    sampling = DynamicSampling(enabled=True, dynamic_bs=True)
    state = LoopState(version=0, next_step=1)
    kept = [_rewarded(0.0, 1.0), _rewarded(1.0, 0.0)]
    state.ready = deque([_rewarded(1.0, 1.0), kept[0]])
    assert take_fresh(_gate(max_staleness=0), state, 4, sampling) is None  # 2 of 4 finished
    state.ready.extend([_rewarded(0.0, 0.0), kept[1], _rewarded(0.0, 1.0)])
    # 2 dropped + 2 kept = 4 finished: a batch of the 2 kept; the fifth waits for the next
    assert take_fresh(_gate(max_staleness=0), state, 4, sampling) == kept
    assert len(state.dropped_uniform) == 2 and len(state.ready) == 1
    assert DynamicSampling(True, True).wanted(4, dropped=9) == (1, 1)  # one kept at least


def test_dynamic_sampling_is_bounded_when_every_group_has_equal_rewards() -> None:
    from areal_cli.rollout.errors import RunFailed

    sampling = DynamicSampling(enabled=True, max_batches=2)
    state = LoopState(version=0, next_step=3)
    spread = _rewarded(0.0, 1.0, start=2)
    state.ready = deque([_rewarded(1.0, 1.0, start=2) for _ in range(3)] + [spread])
    assert take_fresh(_gate(max_staleness=0), state, 2, sampling) is None
    state.ready.append(_rewarded(1.0, 1.0, start=2))  # 4 dropped = 2 batches' worth
    assert take_fresh(_gate(max_staleness=0), state, 2, sampling) == [spread]  # short
    state.dropped_uniform = []
    state.ready = deque([_rewarded(1.0, 1.0, start=2) for _ in range(4)])
    with pytest.raises(RunFailed, match="dropped 4 groups in a row for step 3.*kept none"):
        take_fresh(_gate(max_staleness=0), state, 2, sampling)


def test_dynamic_sampling_reports_the_reward_of_every_fresh_group_it_saw() -> None:
    state = LoopState(version=0, next_step=1)
    state.dropped_uniform = [_rewarded(1.0, 1.0), _rewarded(1.0, 1.0)]
    figures = rollout_figures(_gate(max_staleness=0), 1, [_rewarded(0.0, 1.0)], state, 0.0)
    assert figures["reward_mean"] == 5 / 6  # not the trained group's 0.5
