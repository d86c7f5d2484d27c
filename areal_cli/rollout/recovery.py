"""A restarted inference server rejoins the running rollout loop (launcher.restarts.server).

The launcher restarts the process of a server that died (same command line, port and
log); this module does the rest on the controller's side:

  `down`  the client routes nothing to it: `generate` calls go to the other servers (or
          wait for one to come back), the attempts that failed on it are re-issued
          without counting as retries, and weight updates skip it;
  `up`    once its new process answers /health, it loads the weights every other server
          holds (the newest the loop has loaded; the initial model is what it starts
          with) and reports that version, under the loop's weights lock so that no
          update is missed meanwhile; only then does it take traffic again.

A re-issued request starts over, so no sample mixes tokens from before and after the
restart; every token carries the version of the server that produced it anyway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from areal_cli.rollout.errors import RunFailed
from areal_cli.rollout.state import LoopState
from areal_cli.rollout.sync import GroupSync, WeightSync
from areal_cli.rundir import handoff
from areal_cli.rundir.paths import VERSION_PREFIX

if TYPE_CHECKING:
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.phases import Phases


class ServerRecovery:
    """`down` and `up` of the module docstring for one running loop: its client, the
    weights/ it loads from and its state (the servers' version and the weights lock)."""

    def __init__(
        self,
        client: InferenceClient,
        weights_dir: Path,
        state: LoopState,
        startup_timeout_s: float,
        sync: WeightSync | None = None,
    ) -> None:
        self.client, self.weights_dir = client, weights_dir
        self.state, self.timeout_s = state, startup_timeout_s
        self.sync = sync
        self._down_at: dict[str, float] = {}  # when each server was taken down

    @property
    def _phases(self) -> Phases | None:
        """A colocated run's turns (rollout.phases), else None."""
        return self.sync.phases if self.sync is not None else None

    async def may_start(self, check: Callable[[], None], poll_s: float = 0.2) -> None:
        """Return when a restarted server may start: at once, or in a colocated run once
        the trainer does not hold the devices (rollout.phases); `check` raises if another
        process died meanwhile."""
        phases = self._phases
        while phases is not None and not phases.server_may_start():
            check()
            await asyncio.sleep(poll_s)

    async def _match_the_turn(self, address: str) -> None:
        """Colocated: a restarted server that comes back inside a training turn (the
        handover released the others without it, as it was down) releases its memory
        too, so the next load resumes it with the others. Nothing awaits between this and
        `set_up`, so a handover cannot slip in between."""
        phases = self._phases
        if phases is not None and phases.training_turn:
            await self.client.release_memory_on(address)

    def down(self, address: str) -> None:
        if isinstance(self.sync, GroupSync):
            self.sync.member_lost()
        self._down_at[address] = time.monotonic()
        self.client.set_down(address)

    async def up(self, address: str, check: Callable[[], None]) -> int:
        """Wait for the new process (`check` raises if it died again), load the current
        weights and route to it again; returns the version it holds (0: the initial
        model, -1: none known yet after a resume, which the loop loads on every server)."""
        client = self.client
        deadline = time.monotonic() + self.timeout_s
        while not await client.healthy(address):
            check()
            if time.monotonic() > deadline:
                raise RunFailed(f"server {address} not healthy {self.timeout_s:g}s after a restart")
            await asyncio.sleep(0.2)
        await client.check_identity(address)  # not a stranger that took its port meanwhile
        if isinstance(self.sync, GroupSync):  # never from disk: it receives the next version
            if self.state.version != 0:  # 0: it holds the initial model, as the others
                await self.sync.caught_up(address, self._down_at.get(address, 0.0))
            client.set_up(address)
            return self.state.version
        async with self.state.weights_lock:
            version = self.state.version
            if version > 0:
                entries = handoff.list_entries(self.weights_dir, VERSION_PREFIX)
                entry = next((e for e in entries if e.version == version), None)
                if entry is None:  # collected already: the newest, which all load next
                    entry = entries[-1]
                info = await client.load_weights_on(address, str(entry.path), entry.version)
                if str(info.get("weight_version")) != str(entry.version):
                    raise RunFailed(
                        f"server {address} reports weight version {info.get('weight_version')} "
                        f"after loading v{entry.version} on its restart"
                    )
                version = entry.version
            await self._match_the_turn(address)
            client.set_up(address)
        return version
