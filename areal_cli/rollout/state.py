"""What the parts of the rollout loop share: the long-lived objects (`RolloutContext`), the
mutable state (`LoopState`) and a finished group of episodes (`Group`).

The parts (areal_cli.rollout.controller wires them):
  groups   launch groups as the gate allows (areal_cli.rollout.groups);
  batch    assemble and write step-k's batch (areal_cli.rollout.batch);
  sync     load each new weights/vN on every server (areal_cli.rollout.sync);
  metrics  join the trainer's record of step k with its rollout and handoff figures
           (areal_cli.rollout.metrics).
The staleness decisions are the gate's (areal_cli.rollout.gate), which keeps no state.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from areal_cli.config.schema import ExperimentConfig
from areal_cli.rollout.gate import StalenessGate
from areal_cli.rollout.workflows import Trajectory, Workflow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from areal_cli.data.prompts import Prompt, PromptStream
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.phases import Phases
    from areal_cli.rollout.rewards import RewardPool

GEN_RATE_WINDOW = 5  # batches that gen_tokens_per_s is measured over


@dataclass
class Group:
    """The trajectories of one prompt and the version the servers held when it started."""

    trajectories: list[Trajectory]
    start_version: int
    prompt_index: int
    counters: dict[str, float] = field(default_factory=dict)  # agent episodes' counts

    @property
    def oldest_version(self) -> int:
        return min([self.start_version] + [t.oldest_version for t in self.trajectories])

    @property
    def uniform(self) -> bool:
        """Every episode got the same reward: a group baseline leaves no advantage."""
        return len({t.reward for t in self.trajectories}) <= 1


@dataclass
class LoopState:
    """What the loop's tasks share."""

    version: int  # weight version every server holds (-1: not yet known after a resume)
    next_step: int  # the batch to write next
    in_flight: int = 0  # groups running
    ready: deque[Group | BaseException] = field(default_factory=deque)  # finished, not written
    dropped_stale: int = 0
    dropped_empty: int = 0  # groups whose agent episodes all failed
    carried: dict[str, float] = field(default_factory=dict)  # dropped groups' counters
    dropped_uniform: list[Group] = field(default_factory=list)  # for the next batch (dynamic)
    next_group: int = 0  # the index of the next group to start (seeds its sampling)
    gate_wait_s: float = 0.0  # time with nothing in flight since the last batch
    batch_stats: dict[int, dict[str, float]] = field(default_factory=dict)  # rollout figures
    handoff: dict[int, dict[str, float]] = field(default_factory=dict)  # load figures per vN
    version_changed: asyncio.Event = field(default_factory=asyncio.Event)
    weights_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # loads on the servers
    group_done: asyncio.Event = field(default_factory=asyncio.Event)
    # (client.generated_tokens, client.busy_s()) at the last GEN_RATE_WINDOW batches
    gen_marks: deque[tuple[int, float]] = field(
        default_factory=lambda: deque([(0, 0.0)], GEN_RATE_WINDOW + 1)
    )

    episodes: EpisodeWatch | None = None  # agent episodes in flight (rollout.agent)

    def describe(self) -> str:
        """The rollout loop's state in a few words (for the watchdog's report)."""
        agents = f"; {self.episodes.describe()}" if self.episodes is not None else ""
        return (
            f"rollout loop: next batch step-{self.next_step}, servers on "
            f"v{self.version}, {self.in_flight} groups in flight, {len(self.ready)} ready"
            f"{agents}"
        )


class SessionGroups(Protocol):
    """Online mode's groups (areal_cli.rollout.online.OnlineSessions): a launched group
    is filled by outside sessions; `watch` times out the silent ones (a loop task)."""

    async def group(self, index: int, version: int) -> Group: ...

    async def watch(self) -> None: ...


class EpisodeWatch(Protocol):
    """What the watchdog's report says of the agent episodes (areal_cli.rollout.agents)."""

    def describe(self) -> str: ...


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
    phases: Phases | None = None  # colocated ('|'): the handover between turns
    online: SessionGroups | None = None  # rollout.mode online: sessions fill the groups


class StepSink(Protocol):
    """Where the loop reports (areal_cli.metrics.display.Sink is one)."""

    def status(self, text: str) -> None: ...

    def step(self, metrics: dict[str, float]) -> None: ...

    def warn(self, text: str) -> None: ...
