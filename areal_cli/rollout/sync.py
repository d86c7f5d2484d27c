"""Weight sync: every weights/vN the trainer publishes is loaded on every server, which must
then report vN, before the loop counts the servers as holding vN.

The sync looks for the newest finished entry above the version the servers hold, so when
v2 and v3 both land before it looks, only v3 is loaded (v2's step then has no load
figures in its metrics line). It is woken by inotify the moment an entry is renamed into
weights/; a poll is only the fallback for filesystems that do not report renames (another
node's NFS client). Loads happen under the loop's weights lock, so a restarted server
(areal_cli.rollout.recovery) joins between two loads and misses none.

Handoff figures of each loaded version (into the metrics line of the step that made it):
  handoff_load_s     the load on every server;
  handoff_latency_s  from the finished entry (manifest written) to every server on vN;
  handoff_total_s    from the moment the trainer started writing it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.rollout.errors import RunFailed
from areal_cli.rollout.state import LoopState
from areal_cli.rundir import handoff
from areal_cli.rundir.paths import VERSION_PREFIX

if TYPE_CHECKING:
    from areal_cli.inference.client import InferenceClient


class WeightSync:
    """Loads new weight versions on the servers of `client` and moves `state.version`."""

    def __init__(self, client: InferenceClient, weights_dir: Path, state: LoopState) -> None:
        self.client, self.weights_dir, self.state = client, weights_dir, state

    async def run(self, poll_s: float = 0.02) -> None:
        """Load every newly published version, for ever (the loop cancels it)."""
        watcher = handoff.Watcher(self.weights_dir)  # before the first look: no rename missed
        try:
            while True:
                if not await self.load_newest():
                    await watcher.wait_async(poll_s)
        finally:
            watcher.close()

    async def load_newest(self) -> bool:
        """Load the newest version above the servers' on all of them; False when there is
        none (or no server is up: a restarted one loads it as it comes back). True means
        look again: a newer one may have landed meanwhile."""
        from areal_cli.inference.client import WeightUpdateFailed

        state = self.state
        entry = handoff.newest_after(self.weights_dir, VERSION_PREFIX, state.version)
        if entry is None or not self.client.any_up():
            return False
        t0 = time.perf_counter()
        async with state.weights_lock:  # a restarted server joins between loads
            try:
                answers = await self.client.update_weights_from_disk(str(entry.path), entry.version)
            except WeightUpdateFailed:
                if entry.path.exists():
                    raise
                return True  # the trainer replaced and collected it: load the newer one
            if not answers:  # every server went down meanwhile: their restarts load it
                return True
            await self._check_reported(answers, entry.version)
            state.version = entry.version
        state.handoff[entry.version] = handoff_figures(entry, time.perf_counter() - t0)
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
