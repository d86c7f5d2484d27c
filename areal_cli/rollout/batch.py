"""Step k's batch: assembled from the finished groups the gate still calls fresh, written as
RUN/rollouts/step-k (areal_cli.rundir.batch, handoff protocol) with the step's rollout
figures and the dataset position after it, which a resumed loop starts from.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from areal_cli.rollout.errors import RunFailed
from areal_cli.rollout.state import Group, LoopState, RolloutContext
from areal_cli.rundir import handoff
from areal_cli.rundir.paths import STEP_PREFIX, RunDir

if TYPE_CHECKING:
    from areal_cli.rollout.gate import StalenessGate


class GenerationClock(Protocol):
    """The client's generation counters (InferenceClient has them)."""

    generated_tokens: int

    def busy_s(self) -> float: ...


class StreamPosition(Protocol):
    """A prompt stream's position (areal_cli.data.prompts.PromptStream)."""

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling (`rollout.dynamic_sampling`): a group whose rewards are all
    equal has zero advantage under a group baseline, so it is dropped, not trained on.

    dynamic_bs false (refill): the batch waits for `batch_size` kept groups; the gate
    launches a new group for each one dropped. dynamic_bs true: the batch is written once
    `batch_size` groups finished for it, dropped or kept, and holds the kept ones (AReaL's
    dynamic_bs), so it may be smaller. Either way a batch needs one kept group at least;
    once `max_batches` batches' worth were dropped for one batch, it is written with the
    groups kept so far, and with none the run stops by name (data the model always, or
    never, solves would otherwise draw groups forever)."""

    enabled: bool = False
    dynamic_bs: bool = False
    max_batches: int = 10

    @classmethod
    def from_config(cls, rollout) -> DynamicSampling:
        return cls(rollout.dynamic_sampling, rollout.dynamic_bs, rollout.dynamic_max_batches)

    def exhausted(self, batch_size: int, dropped: int) -> bool:
        """`dropped` groups dropped for one batch reach the bound: write what it has."""
        return self.enabled and dropped >= self.max_batches * batch_size

    def wanted(self, batch_size: int, dropped: int) -> tuple[int, int]:
        """(fewest, most) kept groups the batch is written with, `dropped` groups dropped
        for it so far."""
        if self.exhausted(batch_size, dropped):
            return 1, batch_size
        if self.enabled and self.dynamic_bs:
            return (n := max(1, batch_size - dropped)), n
        return batch_size, batch_size


async def assemble_batch(ctx: RolloutContext, state: LoopState) -> bool:
    """Write batch `next_step` if enough fresh groups are ready; drop stale ones. A
    colocated run first hands the devices to the trainer (rollout.phases)."""
    step = state.next_step
    sampling = DynamicSampling.from_config(ctx.cfg.rollout)
    groups = take_fresh(ctx.gate, state, ctx.cfg.rollout.batch_size, sampling)
    if groups is None:
        return False
    if ctx.phases is not None:
        await ctx.phases.to_training(step)
    write_rollout_batch(ctx, state, step, groups)
    state.dropped_uniform = []
    state.next_step += 1
    return True


def take_fresh(
    gate: StalenessGate, state: LoopState, batch_size: int, sampling: DynamicSampling | None = None
) -> list[Group] | None:
    """Drop (and count) every ready group too stale for batch `next_step`, and with dynamic
    sampling every group of equal rewards; then the first fresh ones as `sampling` wants
    them, or None while fewer are ready. A failed group stops the run."""
    sampling = sampling or DynamicSampling()
    fresh: list[Group] = []
    while state.ready:
        group = state.ready.popleft()
        if isinstance(group, BaseException):
            raise RunFailed(f"a rollout failed: {group}") from group
        if not group.trajectories:  # every agent episode of it was dropped
            state.dropped_empty += 1
            _carry(state, group)
        elif not gate.fresh(state.next_step, group.oldest_version):
            state.dropped_stale += 1
            _carry(state, group)
        elif sampling.enabled and group.uniform:
            state.dropped_uniform.append(group)
        else:
            fresh.append(group)
    fewest, most = sampling.wanted(batch_size, len(state.dropped_uniform))
    if len(fresh) < fewest:
        state.ready.extend(fresh)
        if sampling.exhausted(batch_size, len(state.dropped_uniform)):
            raise RunFailed(
                f"dynamic sampling dropped {len(state.dropped_uniform)} groups in a row for "
                f"step {state.next_step}, every one with equal rewards, and kept none: the "
                "data is too easy or too hard for the model; set rollout.dynamic_sampling: "
                "false, or use other data"
            )
        return None
    state.ready.extend(fresh[most:])
    return fresh[:most]


def _carry(state: LoopState, group: Group) -> None:
    """A dropped group's counters go into the next batch's figures: each agent episode
    or online session is counted once, trained or not."""
    for key, value in group.counters.items():
        state.carried[key] = state.carried.get(key, 0.0) + value


def rollout_figures(
    gate: StalenessGate, step: int, groups: list[Group], state: LoopState, gen_tokens_per_s: float
) -> dict[str, float]:
    """The rollout figures of batch `step` (its part of the metrics line)."""
    trajs = [t for g in groups for t in g.trajectories]
    # with dynamic sampling, the reward of every fresh group: what the policy scores, not
    # only the spread groups it trains on
    rewards = [t.reward for g in groups + state.dropped_uniform for t in g.trajectories]
    staleness = [gate.staleness(step, g.oldest_version) for g in groups]
    return {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        "staleness_mean": statistics.fmean(staleness),
        "staleness_max": float(max(staleness)),
        "gen_tokens": float(sum(t.n_generated for t in trajs)),
        "gen_tokens_per_s": gen_tokens_per_s,
        "reward_errors": float(sum(t.reward_failed for t in trajs)),
        "reward_timeouts": float(sum(t.reward_timed_out for t in trajs)),
        "dropped_stale": float(state.dropped_stale),
        "controller_wait_s": state.gate_wait_s,
        **_summed_counters(groups + state.dropped_uniform, state.carried),
    }


def _summed_counters(groups: list[Group], carried: dict[str, float]) -> dict[str, float]:
    """The agent episodes' counts of the batch's groups, those dropped for it included
    (none for workflows); the dropped groups' record is then cleared."""
    out = dict(carried)
    carried.clear()
    for group in groups:
        for key, value in group.counters.items():
            out[key] = out.get(key, 0.0) + value
    return out


def write_rollout_batch(
    ctx: RolloutContext, state: LoopState, step: int, groups: list[Group]
) -> None:
    """Pack the groups into RUN/rollouts/step-K and remember their figures."""
    from areal_cli.rundir.batch import write_columns

    columns = pack_columns(groups, ctx.cfg.rollout.group_size)
    stats = rollout_figures(ctx.gate, step, groups, state, gen_rate(state, ctx.inference))
    if ctx.cfg.rollout.dynamic_sampling:
        stats["dropped_uniform"] = float(len(state.dropped_uniform))  # for this batch
        stats["batch_groups"] = float(len(groups))
    if ctx.cfg.rollout.agent or ctx.online is not None:
        stats["dropped_empty"] = float(state.dropped_empty)
        stats["batch_samples"] = float(len(columns["seqlens"]))
        stats["batch_tokens"] = float(columns["seqlens"].sum())  # context and generated
    state.gate_wait_s = 0.0
    t0 = time.perf_counter()
    write_columns(
        RunDir(ctx.run_dir).rollouts,
        step,
        columns,
        ctx.cfg.rollout.group_size,
        {"data_state": ctx.stream.state_dict(), "next_group": state.next_group, "stats": stats},
        ctx.cfg.gconfig.max_new_tokens,
    )
    stats["rollout_save_s"] = time.perf_counter() - t0
    state.batch_stats[step] = stats
    handoff.gc(
        RunDir(ctx.run_dir).rollouts,
        STEP_PREFIX,
        keep_last=ctx.cfg.rollout.max_staleness + 2 + ctx.cfg.recover.freq_steps,
    )


def pack_columns(groups: list[Group], group_size: int) -> dict[str, Any]:
    """The groups' trajectories as the numpy columns of a batch file (areal_cli.rundir.
    batch); with group ids when a group does not hold `group_size` of them (agent
    episodes give any number). numpy, not torch: the controller never imports torch."""
    import numpy as np

    trajs = [t for g in groups for t in g.trajectories]
    lengths = [len(t.input_ids) for t in trajs]

    def tokens(key: str, dtype: Any) -> np.ndarray:
        values = (x for t in trajs for x in getattr(t, key))
        return np.fromiter(values, dtype=dtype, count=sum(lengths))

    columns = {
        "input_ids": tokens("input_ids", np.int64),
        "loss_mask": tokens("loss_mask", np.int8),
        "logprobs": tokens("logprobs", np.float32),
        "versions": tokens("versions", np.int32),
        "seqlens": np.array(lengths, dtype=np.int64),
        "rewards": np.array([t.reward for t in trajs], dtype=np.float32),
        "truncated": np.array([t.truncated for t in trajs], dtype=np.bool_),
    }
    if not all(len(g.trajectories) == group_size for g in groups):
        ids = [i for i, g in enumerate(groups) for _ in g.trajectories]
        columns["group_ids"] = np.array(ids, dtype=np.int64)
    return columns


def _pack(groups: list[Group], group_size: int):  # -> areal_cli.rundir.batch.RolloutBatch
    """The batch `pack_columns` writes, as the trainer reads it (for in-process checks)."""
    import torch

    from areal_cli.rundir.batch import RolloutBatch

    t = {k: torch.from_numpy(v) for k, v in pack_columns(groups, group_size).items()}
    return RolloutBatch(group_size=group_size, **t)


def gen_rate(state: LoopState, client: GenerationClock) -> float:
    """gen_tokens_per_s: the tokens the servers answered over the wall time at least one
    /generate call was in flight (InferenceClient.busy_s), over the last GEN_RATE_WINDOW
    batches. Counting by the client's clocks, not by which groups happened to finish
    between two batches, keeps it steady when generation overlaps training."""
    state.gen_marks.append((client.generated_tokens, client.busy_s()))
    (tokens0, busy0), (tokens1, busy1) = state.gen_marks[0], state.gen_marks[-1]
    return (tokens1 - tokens0) / (busy1 - busy0) if busy1 > busy0 else 0.0


def stored_stats(run_dir: Path, step: int) -> dict[str, float]:
    """A step's rollout figures from its batch entry: after a restart, for a step whose
    batch an earlier controller wrote but whose line it never did."""
    try:
        return dict(handoff.read_entry(RunDir(run_dir).rollout(step)).meta["stats"])
    except (handoff.IncompleteEntry, KeyError):
        return {}


def restore_stream(stream: StreamPosition, run_dir: Path, start_step: int) -> int | None:
    """The dataset position after batch start_step-1, saved with it (a resumed run), and
    the index of the next group to start then (None when the batch did not save it)."""
    if start_step == 1:
        return 0
    entry = handoff.latest(RunDir(run_dir).rollouts, STEP_PREFIX)
    if entry is not None and entry.version == start_step - 1 and "data_state" in entry.meta:
        stream.load_state_dict(entry.meta["data_state"])
        return entry.meta.get("next_group")
    return None
