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


async def metrics_task(
    join: MetricsJoin,
    version: Callable[[], int],
    handoff: Mapping[int, Mapping[str, float]],
    sink: StepSink,
    poll_s: float = 0.1,
) -> None:
    """Join and report each step as it completes, for ever (the loop cancels it)."""
    while True:
        for metrics in join.poll(version(), handoff):
            sink.step(metrics)
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
