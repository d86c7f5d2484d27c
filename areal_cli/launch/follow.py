"""The controller of a role with no inference server (`algorithm: sft`, `rm`): it follows the
trainer instead of feeding it.

The trainer reads its own data, so the controller only turns each line the trainer
appends to RUN/logs/trainer-metrics.jsonl into a line of RUN/metrics.jsonl and the
display (a step already in metrics.jsonl, from before a resume, is not written twice),
until the trainer exits cleanly. The guards (the progress watchdog) run beside it; any of
them raising stops the run, as in the rollout loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from areal_cli.rollout.metrics import read_new_lines, steps_in
from areal_cli.rollout.state import StepSink
from areal_cli.rundir.paths import RunDir
from areal_cli.rundir.records import SUPERVISED_FIGURES, TrainerStep


def supervised_metrics(trainer: TrainerStep) -> dict[str, Any]:
    """One metrics.jsonl line from one trainer record."""
    out: dict[str, Any] = {"step": trainer.step}
    out.update(trainer.pick(SUPERVISED_FIGURES))
    out["trainer_step_s"] = trainer.train_s
    out["time"] = time.time()
    return out


async def follow_trainer(
    run_dir: Path,
    sink: StepSink,
    *,
    until_trainer_done: Callable[[], Awaitable[None]],
    guards: list[Awaitable[None]],
    counters: Mapping[str, int] | None = None,
    poll_s: float = 0.1,
) -> None:
    """Relay the trainer's lines until it exits cleanly (see the module docstring)."""
    source = RunDir(run_dir).trainer_metrics
    target = RunDir(run_dir).metrics
    done = steps_in(target)
    offset = 0

    def relay() -> None:
        nonlocal offset
        lines, offset = read_new_lines(source, offset)
        for line in lines:
            record = TrainerStep.from_json(line)
            if record.step in done:
                continue
            metrics = supervised_metrics(record) | dict(counters or {})
            with open(target, "a") as f:
                f.write(json.dumps(metrics) + "\n")
            done.add(record.step)
            sink.step(metrics)

    sink.status("training (no inference server)")
    tasks = [asyncio.ensure_future(g) for g in guards]
    finished = asyncio.ensure_future(until_trainer_done())
    try:
        while not finished.done():
            relay()
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()
            await asyncio.wait([finished, *tasks], timeout=poll_s)
        finished.result()
        relay()  # the trainer's last lines
    finally:
        for task in [*tasks, finished]:
            task.cancel()
        await asyncio.gather(*tasks, finished, return_exceptions=True)
