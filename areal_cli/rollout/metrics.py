"""The metrics join: the trainer's record of step k (a `TrainerStep`, one line of
RUN/logs/trainer-metrics.jsonl), batch k's rollout figures and the handoff figures of
weights/vk become one line of RUN/metrics.jsonl and one step of the display.

A step's line is complete once the servers loaded the weights it produced (step k's are
vk), or newer ones (a version can be skipped when the next lands first: no load figures
then). A step already in metrics.jsonl (written before a restart) is not written twice;
a step whose batch an earlier controller wrote takes its rollout figures from the batch
entry (areal_cli.rollout.batch.stored_stats).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from areal_cli.rollout.state import StepSink
from areal_cli.rundir.paths import RunDir
from areal_cli.rundir.records import RL_FIGURES, TrainerStep, is_eval_row


def build_metrics(
    trainer: TrainerStep, rollout: Mapping[str, float], handoff_stats: Mapping[str, float]
) -> dict[str, Any]:
    """One metrics.jsonl line: rollout, trainer and handoff figures of one step."""
    out: dict[str, Any] = {"step": trainer.step, "weight_version": trainer.weight_version}
    out.update(rollout)
    out.update(trainer.pick(RL_FIGURES))
    out["trainer_step_s"] = trainer.train_s
    out["trainer_wait_s"] = trainer.wait_s
    out["handoff_save_s"] = trainer.publish_s
    out.update(handoff_stats)
    out["time"] = time.time()
    return out


class MetricsJoin:
    """Reads the trainer's new records and writes the lines of the steps that are complete."""

    def __init__(
        self,
        run_dir: Path,
        rollout_figures: Callable[[int], Mapping[str, float]],
        extra: Callable[[], Mapping[str, Any]],
    ) -> None:
        """`rollout_figures(step)` gives batch `step`'s figures; `extra()` the counters
        that every line carries (restarts, re-issued requests)."""
        self.paths = RunDir(run_dir)
        self.rollout_figures, self.extra = rollout_figures, extra
        self.done = steps_in(self.paths.metrics)
        self.pending: dict[int, TrainerStep] = {}
        self.offset = 0

    def poll(self, version: int, handoff: Mapping[int, Mapping[str, float]]) -> list[dict]:
        """Write the line of every step the servers' `version` completes; returns them."""
        lines, self.offset = read_new_lines(self.paths.trainer_metrics, self.offset)
        for line in lines:
            record = TrainerStep.from_json(line)
            if record.step not in self.done:
                self.pending[record.step] = record
        written = []
        for step in sorted(s for s in self.pending if version >= s):
            record = self.pending.pop(step)
            metrics = build_metrics(record, self.rollout_figures(step), handoff.get(step, {}))
            metrics |= self.extra()
            with open(self.paths.metrics, "a") as f:
                f.write(json.dumps(metrics) + "\n")
            self.done.add(step)
            written.append(metrics)
        return written


# (what ended, of how many, the limit, what it is, what may help): a step where more than
# half of them timed out gets one warning per run
TIMEOUT_SHARES = (
    ("agent_timeouts", "agent_episodes", "rollout.agent_timeout_s", "agent episodes",
     "run fewer at once (rollout.max_concurrent_rollouts)"),
    ("online_timeouts", "online_sessions", "rollout.session_timeout_s", "online sessions",
     "check that the clients end their sessions"),
)  # fmt: skip


def timeout_warnings(
    metrics: Mapping[str, Any], warned: set[str], limits: Mapping[str, float] | None = None
) -> list[str]:
    """A line for each kind of work of which most timed out in this step (dropped, not
    trained), once per run (`warned` keeps the kinds said; `limits` the limits' values by
    key, for the line). A limit too short for the servers' speed looks like this: the
    work is thrown away, and each step then needs more of it."""
    lines = []
    for lost_key, total_key, limit, what, other in TIMEOUT_SHARES:
        lost, total = metrics.get(lost_key, 0.0), metrics.get(total_key, 0.0)
        if lost_key in warned or not total or lost * 2 <= total:
            continue
        warned.add(lost_key)
        value = (limits or {}).get(limit)
        past = limit if value is None else f"{limit} ({value:g} s)"
        lines.append(
            f"step {metrics['step']}: {lost:g} of {total:g} {what} ran past {past} and were "
            f"dropped untrained; if the servers are slower than the limit allows, raise "
            f"{limit}, or {other}"
        )
    return lines


async def metrics_task(
    join: MetricsJoin,
    version: Callable[[], int],
    handoff: Mapping[int, Mapping[str, float]],
    sink: StepSink,
    limits: Mapping[str, float] | None = None,
    poll_s: float = 0.1,
) -> None:
    """Join and report each step as it completes, for ever (the loop cancels it); a
    step that lost most of its work to a time limit (`limits`, by key) gets a warning."""
    warned: set[str] = set()
    while True:
        for metrics in join.poll(version(), handoff):
            sink.step(metrics)
            for line in timeout_warnings(metrics, warned, limits):
                sink.warn(line)
        await asyncio.sleep(poll_s)


def steps_in(path: Path) -> set[int]:
    """The steps that have a line in a metrics file (not counting eval rows)."""
    if not path.exists():
        return set()
    rows = (json.loads(line) for line in path.read_text().splitlines() if line)
    return {row["step"] for row in rows if not is_eval_row(row)}


def read_new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines appended to `path` since `offset`."""
    if not path.exists():
        return [], offset
    with open(path) as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind("\n") + 1]
    return [line for line in complete.splitlines() if line], offset + len(complete.encode())
