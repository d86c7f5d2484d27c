"""Step k's batch: assembled from the finished groups the gate still calls fresh, written as
RUN/rollouts/step-k (areal_cli.rundir.batch, handoff protocol) with the step's rollout
figures and the dataset position after it, which a resumed loop starts from.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from areal_cli.rollout.errors import RunFailed
from areal_cli.rollout.state import Group, LoopState, RolloutContext
from areal_cli.rollout.workflows import Trajectory
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


def assemble_batch(ctx: RolloutContext, state: LoopState) -> bool:
    """Write batch `next_step` if enough fresh groups are ready; drop stale ones."""
    step = state.next_step
    groups = take_fresh(ctx.gate, state, ctx.cfg.rollout.batch_size)
    if groups is None:
        return False
    write_rollout_batch(ctx, state, step, groups)
    state.next_step += 1
    return True


def take_fresh(gate: StalenessGate, state: LoopState, batch_size: int) -> list[Group] | None:
    """Drop (and count) every ready group too stale for batch `next_step`; then the first
    `batch_size` fresh ones, or None while fewer are ready. A failed group stops the run."""
    fresh: list[Group] = []
    while state.ready:
        group = state.ready.popleft()
        if isinstance(group, BaseException):
            raise RunFailed(f"a rollout failed: {group}") from group
        if not gate.fresh(state.next_step, group.oldest_version):
            state.dropped_stale += 1
            continue
        fresh.append(group)
    if len(fresh) < batch_size:
        state.ready.extend(fresh)
        return None
    state.ready.extend(fresh[batch_size:])
    return fresh[:batch_size]


def rollout_figures(
    gate: StalenessGate, step: int, groups: list[Group], state: LoopState, gen_tokens_per_s: float
) -> dict[str, float]:
    """The rollout figures of batch `step` (its part of the metrics line)."""
    trajs = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajs]
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
    }


def write_rollout_batch(
    ctx: RolloutContext, state: LoopState, step: int, groups: list[Group]
) -> None:
    """Pack the groups into RUN/rollouts/step-K and remember their figures."""
    from areal_cli.rundir.batch import write_batch

    batch = _pack([t for g in groups for t in g.trajectories], ctx.cfg.rollout.group_size)
    batch.max_new_tokens = ctx.cfg.gconfig.max_new_tokens
    stats = rollout_figures(ctx.gate, step, groups, state, gen_rate(state, ctx.inference))
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


def _pack(trajs: list[Trajectory], group_size: int):  # -> areal_cli.rundir.batch.RolloutBatch
    import torch

    from areal_cli.rundir.batch import RolloutBatch

    seqs = [
        {
            "input_ids": torch.tensor(t.input_ids, dtype=torch.int64),
            "loss_mask": torch.tensor(t.loss_mask, dtype=torch.int8),
            "logprobs": torch.tensor(t.logprobs, dtype=torch.float32),
            "versions": torch.tensor(t.versions, dtype=torch.int32),
        }
        for t in trajs
    ]
    batch = RolloutBatch.from_sequences(seqs, [t.reward for t in trajs], group_size)
    batch.truncated = torch.tensor([t.truncated for t in trajs], dtype=torch.bool)
    return batch


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


def restore_stream(stream: StreamPosition, run_dir: Path, start_step: int) -> None:
    """The dataset position after batch start_step-1, saved with it (a resumed run)."""
    if start_step == 1:
        return
    entry = handoff.latest(RunDir(run_dir).rollouts, STEP_PREFIX)
    if entry is not None and entry.version == start_step - 1 and "data_state" in entry.meta:
        stream.load_state_dict(entry.meta["data_state"])
