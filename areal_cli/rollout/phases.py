"""Colocated runs (`a|b` in the allocation): rollout and training take turns on the same
devices.

With `rollout.max_staleness: 0`, which config.rules insists on here, the loop alternates
already: batch k is generated with the weights after k-1 steps, and no group of batch
k+1 starts before weights vk are on the servers. Colocation adds the handover between
the turns:

  to training  batch k is complete: no new /generate call goes out (the clients'
               GenerationGate, evaluation's included), the calls in flight end, and every
               server releases its weights' and KV cache's memory; only then is the batch
               written, and the trainer, which gave back its devices after its last step
               (trainer.offload), takes them for step k.
  to rollout   weights vk are published: once every trainer rank has given the devices
               back (its heartbeat says so: on a GPU after its step's saves and the
               offload, on a CPU, where nothing moves, right after publishing vk, so the
               saves overlap the next rollout), the servers take back their weights'
               memory, load vk (the weight sync), take back the KV cache's, and the gate
               opens.

A server that dies during a training turn is started again only once the trainer has
given the devices back (`Phases.server_may_start`, which ServerRecovery polls): a server
that starts takes its memory (weights, and on a GPU its KV cache's share), which the
trainer holds while it steps. Waiting for the whole rollout turn instead would deadlock a
run whose only server died: the turn begins with the load of the new version, and a load
needs a server that is up. A restarted server that comes back inside a training turn
(the handover skipped it: it was down) releases its memory before it takes traffic again
(ServerRecovery), so the next load resumes it with the others.

The servers outlive a rollout loop: when the trainer dies the controller relaunches it
and starts a new loop, with a new client, while the servers may still be released for a
training turn the dead trainer never finished. So whether they are released, and whether
a training turn is on, live in a `ServerTurn` that the controller keeps across its loops;
a new loop's `Phases` begins from it (`begin`: the gate stays shut until the servers are
loaded and resumed, as at the end of any training turn), instead of sending generation to
servers that hold no memory (the run then waited for the watchdog).

Each step's metrics line has `colocated` 1 and the handover's figures:
  phase_release_s       the calls in flight ending and the servers releasing (before k);
  phase_trainer_wait_s  from vk's publication until the trainer had given back;
  phase_resume_s        the servers taking their memory back (the load itself is
                        handoff_load_s).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from areal_cli.rundir import handoff, heartbeat

if TYPE_CHECKING:
    from areal_cli.inference.client import InferenceClient

TRAINER_BEAT = "trainer-"  # the trainer ranks' heartbeat names (trainer.main)


def trainer_gave_back(run_dir: Path) -> bool:
    """Whether no trainer rank holds the devices now (each says so in its heartbeat,
    trainer.state.give_back; a rank without a heartbeat yet holds none)."""
    return not any(
        beat.holds_devices for beat in heartbeat.read_all(run_dir, TRAINER_BEAT).values()
    )


@dataclass
class ServerTurn:
    """The servers' side of the turns, kept by the controller across its rollout loops
    (see the module docstring)."""

    released: bool = False  # every server gave its memory back and has not resumed it
    training_turn: bool = False  # from the handover to training until the next load


class Phases:
    """The handover between a colocated run's turns (see the module docstring)."""

    def __init__(
        self,
        client: InferenceClient,
        trainer_idle: Callable[[], bool],
        poll_s: float = 0.02,
        watcher: handoff.Watcher | None = None,
        turn: ServerTurn | None = None,
    ) -> None:
        """`trainer_idle()` says whether the trainer has given the devices back; it is
        asked again whenever `watcher` (on the heartbeat folder) sees a heartbeat
        renamed in, and every `poll_s` without one. `turn`: where an earlier loop left
        the servers (a fresh one when None)."""
        self.client, self.trainer_idle, self.poll_s = client, trainer_idle, poll_s
        self.watcher = watcher
        self.turn = turn if turn is not None else ServerTurn()
        self.figures: dict[int, dict[str, float]] = {}  # by step (= the version it makes)

    @classmethod
    def for_run(
        cls, client: InferenceClient, run_dir: Path, turn: ServerTurn | None = None
    ) -> Phases:
        watcher = handoff.Watcher(Path(run_dir) / heartbeat.HEARTBEAT_DIR)
        return cls(client, lambda: trainer_gave_back(run_dir), 0.5, watcher, turn)

    @property
    def released(self) -> bool:
        return self.turn.released

    @released.setter
    def released(self, value: bool) -> None:
        self.turn.released = value

    @property
    def training_turn(self) -> bool:
        return self.turn.training_turn

    @training_turn.setter
    def training_turn(self, value: bool) -> None:
        self.turn.training_turn = value

    async def begin(self) -> None:
        """A new loop over servers an earlier loop released (its trainer died in a
        training turn): no generation until they are loaded and resumed (after_load)."""
        if self.turn.released:
            await self.client.gate.hold()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()

    def _add(self, step: int, key: str, seconds: float) -> None:
        figures = self.figures.setdefault(step, {"colocated": 1.0})
        figures[key] = figures.get(key, 0.0) + seconds

    async def to_training(self, step: int) -> None:
        """Batch `step` is complete and about to be written: hand the devices over."""
        start = time.perf_counter()
        await self.client.gate.hold()
        self.training_turn = True  # from here no server starts (see the docstring)
        await self.client.release_memory()
        self.released = True
        self._add(step, "phase_release_s", time.perf_counter() - start)

    async def before_load(self, version: int) -> None:
        """Weights `version` are published: wait for the trainer to give the devices back,
        then the servers take back their weights' memory for the load."""
        if not self.released:
            return
        start = time.perf_counter()
        while not self.trainer_idle():
            if self.watcher is None:
                await asyncio.sleep(self.poll_s)
            else:  # woken by the trainer's next heartbeat
                await self.watcher.wait_async(self.poll_s)
        waited = time.perf_counter()
        await self.client.resume_memory(["weights"])
        self._add(version, "phase_trainer_wait_s", waited - start)
        self._add(version, "phase_resume_s", time.perf_counter() - waited)

    async def after_load(self, version: int) -> None:
        """The servers hold `version`: the KV cache's memory back, and generation goes on."""
        if self.released:
            start = time.perf_counter()
            await self.client.resume_memory(["kv_cache"])
            self.released = False
            self._add(version, "phase_resume_s", time.perf_counter() - start)
        self.training_turn = False
        self.client.gate.open()

    def server_may_start(self) -> bool:
        """Whether a restarted server may start now: outside a training turn, or once the
        trainer has given the devices back (see the module docstring)."""
        return not self.training_turn or self.trainer_idle()

    def take(self, version: int) -> dict[str, float]:
        """The figures for the metrics line of step `version` (once)."""
        return self.figures.pop(version, {})
