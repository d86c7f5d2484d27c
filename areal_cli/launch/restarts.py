"""Relaunching what died instead of stopping the run (`launcher.restarts`).

A trainer rank that dies takes its torchrun job down with it (torchrun stops the other
ranks and exits non-zero). The controller then relaunches the whole trainer from the
newest recover checkpoint, as `areal train --resume` would, while the inference servers
keep running:

  1. what is left of the old job's process group is killed; when the run directory's
     file system is full or read-only (areal_cli.rundir.disk), the run stops instead;
  2. the steps after the checkpoint are forgotten (`trim_after`: their rollouts, their
     weights and their metrics lines), so they are redone, each written once;
  3. the trainer starts again with --resume: it loads recover/step-K and republishes its
     weights as vK, which the servers load before the rollout loop, restarted at step
     K+1 from the dataset position stored with rollouts/step-K, draws anything new.
     Without a recover entry the run restarts from step 1, and the servers restart too
     (they hold weights trained after the start).

An inference server that dies is restarted on its own (same command line, port and log)
while the rest of the run goes on; areal_cli.rollout.recovery takes it out of routing
until it is healthy and holds the weights the other servers hold.

Each restart counts against `launcher.restarts.trainer` (or `.server`, per server) within
`window_s`; past it the failure stops the run as before, saying why.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.launch.local import ChildFailed, LocalRunner
from areal_cli.rundir import handoff, heartbeat
from areal_cli.rundir.disk import diagnose
from areal_cli.rundir.layout import trim_after
from areal_cli.rundir.paths import STEP_PREFIX, RunDir

if TYPE_CHECKING:
    from areal_cli.rollout.recovery import ServerRecovery


class RestartBudget:
    """How many restarts each process has left within the window (limits by kind:
    trainer, server; counted per process)."""

    def __init__(self, limits: dict[str, int], window_s: float) -> None:
        self.limits, self.window_s = limits, window_s
        self._times: dict[str, deque[float]] = {}

    def take(self, kind: str, name: str, now: float | None = None) -> bool:
        """Count one restart of process `name` if its kind's limit allows it."""
        now = time.monotonic() if now is None else now
        recent = self._times.setdefault(name, deque())
        while recent and now - recent[0] > self.window_s:
            recent.popleft()
        if len(recent) >= self.limits[kind]:
            return False
        recent.append(now)
        return True

    def refused(self, kind: str, name: str) -> str:
        return (
            f"{len(self._times.get(name, ()))} restart(s) of {name} within "
            f"{self.window_s:g} s already (launcher.restarts.{kind}: {self.limits[kind]})"
        )


class Restarter:
    """Restarts the processes of a local run within `launcher.restarts`, and counts them
    (`counters`, which go into every metrics line)."""

    def __init__(self, runner: LocalRunner, limits: Any, sink: Any) -> None:
        self.runner, self.sink = runner, sink
        self.budget = RestartBudget(
            {"trainer": limits.trainer, "server": limits.server}, limits.window_s
        )
        self.counters = {"trainer_restarts": 0, "server_restarts": 0}
        self.on_restart: Any = lambda: None  # after each restart (RUN/run.json's pids)

    def _allowed(self, failed: ChildFailed, kind: str) -> bool:
        name = failed.child.spec.name
        if self.budget.take(kind, name):
            return True
        self.sink.warn(f"not restarting {name}: {self.budget.refused(kind, name)}")
        return False

    def trainer(self, failed: ChildFailed, run_dir: Path, argv: list[str]) -> int:
        """Relaunch the trainer (steps 1-3 of the module docstring); returns the step the
        run continues from. Raises `failed` past the limit."""
        self.runner.stop(failed.child)  # before the trim: no rank of the old job writes after it
        problem = diagnose(run_dir)
        if problem is not None:  # it would fail the same way again
            raise problem
        if not self._allowed(failed, "trainer"):
            raise failed
        entry = handoff.latest(RunDir(run_dir).recover, STEP_PREFIX)
        start = entry.version + 1 if entry else 1
        where = f"{entry.path}, at step {start}" if entry else "the start (no recover entry yet)"
        self.sink.warn(f"{failed}; relaunching the trainer from {where}")
        trim_after(run_dir, start - 1)
        heartbeat.clear(run_dir)
        if entry is None:
            for child in [c for c in self.runner.children if c.spec.role.startswith("inference")]:
                self.runner.stop(child)
                self.runner.start(child.spec, child.argv)
        self.runner.start(failed.child.spec, argv)
        self.counters["trainer_restarts"] += 1
        self.on_restart()
        return start

    async def server(self, failed: ChildFailed, recovery: ServerRecovery, address: str) -> None:
        """Restart a server that died and bring it back into the loop (ServerRecovery);
        raises `failed` past the limit."""
        name = failed.child.spec.name
        recovery.down(address)
        while True:
            if not self._allowed(failed, "server"):
                raise failed
            self.sink.warn(f"{failed}; restarting it")
            self.runner.stop(failed.child)
            check = lambda: self.runner.check(allow_exit={"trainer"})  # noqa: E731
            await recovery.may_start(check)  # colocated: not while the trainer holds the devices
            child = self.runner.start(failed.child.spec, failed.child.argv)
            try:
                version = await recovery.up(address, check=check)
                break
            except ChildFailed as again:
                if again.child is not child:
                    raise
                failed = again  # it died again while starting: another restart
        self.counters["server_restarts"] += 1
        self.on_restart()
        self.sink.status(f"{name} restarted; it serves v{version}")
