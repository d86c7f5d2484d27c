"""Weight sync: every weights/vN the trainer publishes is loaded on every server, which must
then report vN, before the loop counts the servers as holding vN.

The sync looks for the newest finished entry above the version the servers hold, so when
v2 and v3 both land before it looks, only v3 is loaded (v2's step then has no load
figures in its metrics line). It is woken by inotify the moment an entry is renamed into
weights/; a poll is only the fallback for filesystems that do not report renames (another
node's NFS client). Loads happen under the loop's weights lock, so a restarted server
(areal_cli.rollout.recovery) joins between two loads and misses none.

Under `actor.weight_update.method: distributed` (`GroupSync`) a version does not travel
as a folder: the trainer announces it as an entry vN whose manifest lists its buckets,
and broadcasts them over the weight-update group (areal_cli.rundir.weight_group) while
the servers receive them bucket by bucket, as this module asks. The trainer's rank 0
writes weights/group.json with a fresh token each time it (re)forms the group (at start,
after a relaunch, after a send that failed); the sync then has every server join, waiting
first for a restarting one to answer /health, since the group counts it. Every version
announced with that token is received, in order: none is skipped, since the trainer waits
for the servers to take each one. A receive that fails (a member died) waits for the
trainer's next group, up to the collective timeout, and then stops the run naming the
servers; a restarted server takes traffic once it has received a whole version
(`caught_up`).

Handoff figures of each loaded version (into the metrics line of the step that made it):
  handoff_load_s     the load on every server;
  handoff_latency_s  from the finished entry (manifest written) to every server on vN;
  handoff_total_s    from the moment the trainer started writing it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.rollout.errors import RunFailed
from areal_cli.rollout.state import LoopState
from areal_cli.rundir import handoff
from areal_cli.rundir.paths import VERSION_PREFIX
from areal_cli.rundir.weight_group import (
    Announced,
    GroupSpec,
    announced_group,
    group_token,
    mark_left,
    update_body,
)

if TYPE_CHECKING:
    from areal_cli.inference.client import InferenceClient
    from areal_cli.rollout.phases import Phases


class WeightSync:
    """Loads new weight versions on the servers of `client` and moves `state.version`."""

    def __init__(
        self,
        client: InferenceClient,
        weights_dir: Path,
        state: LoopState,
        phases: Phases | None = None,
    ) -> None:
        """`phases`: a colocated run's handover around each load (rollout.phases)."""
        self.client, self.weights_dir, self.state = client, weights_dir, state
        self.phases = phases

    async def run(self, poll_s: float = 0.02) -> None:
        """Load every newly published version, for ever (the loop cancels it)."""
        watcher = handoff.Watcher(self.weights_dir)  # before the first look: no rename missed
        try:
            while True:
                if not await self.load_newest():
                    await watcher.wait_async(poll_s)
        finally:
            watcher.close()

    async def caught_up(self, address: str, since: float) -> None:
        """Returns at once: a restarted server loads from disk (ServerRecovery.up)."""
        return None

    async def load_newest(self) -> bool:
        """Load the newest version above the servers' on all of them; False when there is
        none (or no server is up: a restarted one loads it as it comes back). True means
        look again: a newer one may have landed meanwhile."""
        from areal_cli.inference.client import WeightUpdateFailed

        state = self.state
        entry = handoff.newest_after(self.weights_dir, VERSION_PREFIX, state.version)
        if entry is None or not self.client.any_up():
            return False
        phases = self.phases
        async with state.weights_lock:  # a restarted server joins between loads
            if phases is not None:
                await phases.before_load(entry.version)
            t0 = time.perf_counter()
            try:
                answers = await self.client.update_weights_from_disk(str(entry.path), entry.version)
            except WeightUpdateFailed:
                if entry.path.exists():
                    raise
                return True  # the trainer replaced and collected it: load the newer one
            if not answers:  # every server went down meanwhile: their restarts load it
                return True
            await self._check_reported(answers, entry.version)
            load_s = time.perf_counter() - t0
            if phases is not None:
                await phases.after_load(entry.version)
            state.version = entry.version
        figures = handoff_figures(entry, load_s)
        state.handoff[entry.version] = figures | (phases.take(entry.version) if phases else {})
        state.version_changed.set()
        return True

    async def _check_reported(self, answers: list[dict[str, Any]], version: int) -> None:
        """Every server must report `version` (asked on /model_info: SGLang's load answer
        does not say)."""
        if not all("weight_version" in answer for answer in answers):
            answers = await self.client.model_info()
        reported = {str(answer.get("weight_version")) for answer in answers}
        if reported != {str(version)}:
            raise RunFailed(
                f"servers report weight versions {sorted(reported)} after loading v{version}"
            )


def handoff_figures(entry: handoff.Entry, load_s: float) -> dict[str, float]:
    """The handoff figures of a version loaded in `load_s` (see the module docstring)."""
    now = time.time()
    created = float(entry.manifest["created"])
    return {
        "handoff_load_s": load_s,
        "handoff_latency_s": now - created,
        "handoff_total_s": now - float(entry.meta.get("publish_started", created)),
    }


@dataclass(frozen=True)
class GroupPlan:
    """The weight-update group as the plan made it: its spec, and each server's first
    rank in it (by address)."""

    spec: GroupSpec
    ranks: Mapping[str, int]


class GroupSync(WeightSync):
    """WeightSync over the weight-update group (see the module docstring)."""

    def __init__(
        self,
        client: InferenceClient,
        weights_dir: Path,
        state: LoopState,
        group: GroupPlan,
        startup_timeout_s: float,
    ) -> None:
        super().__init__(client, weights_dir, state)
        self.group, self.startup_timeout_s = group, startup_timeout_s
        self.token = ""  # of the group the servers are in
        self._received: dict[str, float] = {}  # when each server last took a whole version
        self._new_version = asyncio.Condition()

    async def caught_up(self, address: str, since: float) -> None:
        """Wait until the server at `address` (restarted) has received a whole version
        after `since` (time.monotonic(): when it was taken down)."""
        async with self._new_version:
            await self._new_version.wait_for(lambda: self._received.get(address, 0.0) > since)

    async def load_newest(self) -> bool:
        group = announced_group(self.weights_dir)
        if group.token and group.token != self.token:
            await self._join(group)
            return True
        entry = self._next_entry()
        if entry is None:
            return False
        from areal_cli.inference.client import WeightUpdateFailed

        t0 = time.perf_counter()
        addresses = list(self.group.ranks)
        buckets = entry.meta["buckets"]
        failed = ""
        async with self.state.weights_lock:
            try:
                for i, bucket in enumerate(buckets):
                    last = i == len(buckets) - 1
                    version = str(entry.version) if last else None
                    body = update_body(bucket, version, self.group.spec.group_name)
                    answers = await self.client.receive_weights(addresses, body, i == 0)
            except WeightUpdateFailed as exc:
                failed = str(exc)
            else:
                await self._check_reported(answers, entry.version)
                self.state.version = entry.version
        if failed:  # wait for the trainer's next group without holding the lock
            await self._after_failure(failed)
            return True
        for address in addresses:
            self._received[address] = time.monotonic()
        async with self._new_version:
            self._new_version.notify_all()
        self.state.handoff[entry.version] = handoff_figures(entry, time.perf_counter() - t0)
        self.state.version_changed.set()
        return True

    def _next_entry(self) -> handoff.Entry | None:
        """The oldest version announced in this group that the servers do not hold."""
        if not self.token:
            return None
        for entry in handoff.list_entries(self.weights_dir, VERSION_PREFIX):
            if entry.meta.get("group") == self.token and entry.version > self.state.version:
                return entry
        return None

    def member_lost(self) -> None:
        """A server of the current group died (ServerRecovery.down): tell the trainer,
        whose send to it may otherwise wait out the timeout (rundir.weight_group)."""
        if self.token:
            mark_left(self.weights_dir, self.token)

    async def _join(self, group: Announced) -> None:
        """Every server joins the group the trainer's rank 0 announced, at the address and
        port it gave (a restarting server once it answers /health: the group counts it)."""
        token = group.token
        deadline = time.monotonic() + self.startup_timeout_s
        for address in self.group.ranks:
            while not await self.client.healthy(address):
                if time.monotonic() > deadline:
                    raise RunFailed(
                        f"server {address} is not healthy, so it cannot join the "
                        f"weight-update group {token} (waited {self.startup_timeout_s:g}s)"
                    )
                await asyncio.sleep(0.2)
        from areal_cli.inference.client import WeightUpdateFailed

        spec = replace(
            self.group.spec,
            master_address=group.master_address or self.group.spec.master_address,
            master_port=group.master_port or self.group.spec.master_port,
        )
        bodies = {address: spec.init_body(rank) for address, rank in self.group.ranks.items()}
        try:
            await self.client.join_weight_group(bodies)
        except WeightUpdateFailed as exc:
            await self._after_failure(str(exc))
            return
        self.token = token

    async def _after_failure(self, why: str) -> None:
        """A join or receive failed: the trainer forms a new group when a member died;
        wait for it, or stop the run naming the servers."""
        failed_token = self.token or group_token(self.weights_dir)
        deadline = time.monotonic() + self.group.spec.timeout_s
        while time.monotonic() < deadline:
            token = group_token(self.weights_dir)
            if token and token != failed_token:
                self.token = ""  # join the new group at the next look
                return
            await asyncio.sleep(0.2)
        raise RunFailed(
            f"the distributed weight update failed and the trainer formed no new group "
            f"within {self.group.spec.timeout_s:g}s: {why}"
        )
