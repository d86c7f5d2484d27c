"""The progress watchdog: a run that stops making progress becomes a named error.

The controller calls `ProgressWatchdog.check` about once a second with what it can see:
the trainer ranks' heartbeats (RUN/heartbeat/trainer-<rank>.json: phase, since when,
steps done) and each inference server's request counters (requests in flight, when one
last finished). The rules, with `limit` from `limit()`:

  1. A trainer rank that has been in one phase for longer than `limit`, other than
     waiting for its rollout batch, is stuck.
  2. When no trainer step finished for longer than `limit` and the trainer waits for
     rollouts (or never reported at all), the rollout side is stuck unless a server
     answered a call within `limit`: a server that holds calls (generate, weight update)
     and answers none is named; with none in flight, the controller's rollout loop is
     (not with rollout.mode online, whose requests are outside clients' to send).

`limit` is `launcher.watchdog.timeout_s` when set. Otherwise it is `step_time_factor`
times the slowest of the last 10 steps (as the trainer timed them), at least
`min_timeout_s`; until the first step finishes it is also at least
`launcher.startup_timeout_s` (model build, first rollouts).

For a stuck trainer `watch` then asks every rank for its stacks (SIGUSR1, see
areal_cli.rundir.heartbeat), and `explain_trainer` tells the rank that waits inside a
collective from the one it waits for; for the rollout side it asks each server's
/health. It raises RunStuck with the whole story; the controller stops the run.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_cli.config.schema import ExperimentConfig
from areal_cli.rundir import heartbeat
from areal_cli.rundir.heartbeat import Beat
from areal_cli.rundir.paths import RunDir


class RunStuck(RuntimeError):
    """The watchdog saw no progress within its limit; the message names what is stuck."""


WAITING = "wait for "  # the trainer's phase while it waits for its rollout batch


@dataclass(frozen=True)
class ServerActivity:
    """What the controller's client knows of one server."""

    name: str
    pending: dict[str, int]  # calls in flight by path (/generate, /update_weights_from_disk)
    last_done: float  # wall time a call was last answered (or the client started)

    def holds(self) -> str:
        """`3 /generate and 1 /update_weights_from_disk` (what it holds unanswered)."""
        return " and ".join(f"{n} {path}" for path, n in sorted(self.pending.items()))


@dataclass(frozen=True)
class Stuck:
    """The watchdog's verdict: which side is stuck, for how long, and what it was doing."""

    side: str  # "trainer" or "rollout"
    headline: str  # "trainer made no progress for 61 s (limit 60 s)"
    detail: str  # what each part was last doing
    ranks: tuple[Beat, ...] = ()

    @property
    def message(self) -> str:
        return f"{self.headline}: {self.detail}"


class ProgressWatchdog:
    """Decides whether the run is stuck; pure apart from the times it is given."""

    def __init__(self, cfg: ExperimentConfig, start: float) -> None:
        w = cfg.launcher.watchdog
        self.fixed = w.timeout_s
        self.floor = w.min_timeout_s
        self.factor = w.step_time_factor
        self.startup = cfg.launcher.startup_timeout_s
        self.start = start
        self.steps_done = -1  # unknown until the first heartbeat
        self.last_step_at = start
        self.step_times: deque[float] = deque(maxlen=10)
        # rollout.mode online: outside clients send the requests, and a run that waits for
        # them waits by design; only a server that holds calls and answers none is stuck
        self.outside = cfg.rollout.mode == "online"

    def limit(self) -> float:
        """Seconds without progress after which the run counts as stuck."""
        if self.fixed is not None:
            derived = self.fixed
        else:
            derived = max(self.floor, self.factor * max(self.step_times, default=0.0))
        return derived if self.step_times else max(derived, self.startup)

    def observe(self, beats: dict[str, Beat], now: float) -> None:
        """Note finished steps (the slowest rank's count), when the watchdog saw them, and
        how long the slowest rank says its last step took (waiting for data included)."""
        if not beats:
            return
        done = min(b.steps_done for b in beats.values())
        if done > self.steps_done:
            if self.steps_done >= 0:
                self.last_step_at = now
            slowest = max(b.step_s for b in beats.values())
            if slowest > 0:  # 0: no step finished yet in this process (a fresh or resumed trainer)
                self.step_times.append(slowest)
            self.steps_done = done

    def check(
        self, beats: dict[str, Beat], servers: list[ServerActivity], now: float
    ) -> Stuck | None:
        """The verdict for this moment, or None while the run makes progress."""
        self.observe(beats, now)
        limit = self.limit()
        ranks = tuple(sorted(beats.values(), key=_rank))
        busy = [b for b in ranks if not b.phase.startswith(WAITING)]
        stale = [b for b in busy if now - b.since > limit]
        if stale:
            oldest = max(now - b.since for b in stale)
            return Stuck(
                "trainer",
                f"trainer made no progress for {oldest:.0f} s (limit {limit:.0f} s)",
                describe_ranks(ranks, now),
                ranks,
            )
        if busy or now - self.last_step_at <= limit:
            return None
        if any(now - s.last_done <= limit for s in servers):
            return None  # rollouts are being generated, only slowly
        idle_for = now - max([s.last_done for s in servers] + [self.last_step_at])
        waiting = (
            f"the trainer waits in '{ranks[0].phase}'"
            if ranks
            else f"the trainer reported nothing for {now - self.start:.0f} s"
        )
        headline = f"no rollout progress for {idle_for:.0f} s (limit {limit:.0f} s)"
        hung = [s for s in servers if s.pending]
        if self.outside and not hung:
            return None  # online: the requests are the outside clients' to send
        if hung:
            held = ", ".join(f"{s.name} holds {s.holds()} call(s)" for s in hung)
            return Stuck("rollout", headline, f"{held} and answered none; {waiting}", ranks)
        return Stuck(
            "rollout", headline, f"the controller sent no request to the servers; {waiting}", ranks
        )


def _rank(beat: Beat) -> int:
    tail = beat.name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def describe_ranks(ranks: tuple[Beat, ...], now: float) -> str:
    """`rank 0 in 'step 3: train mb 2/4' for 61 s; rank 1 in ...`"""
    return "; ".join(f"rank {_rank(b)} in '{b.phase}' for {now - b.since:.0f} s" for b in ranks)


# ------------------------------------------------------------------ stack dumps

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def main_thread_frames(dump: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the main thread, innermost first, from a faulthandler
    dump; the main thread is the one whose outermost frame is a module (`<module>`)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    for block in reversed(blocks):  # the newest dump is last in the file
        frames = [(m["file"], int(m["line"]), m["func"]) for m in _FRAME.finditer(block)]
        if frames and frames[-1][2] in ("<module>", "_run_module_as_main"):
            return frames
    return []


def in_collective(frames: list[tuple[str, int, str]]) -> bool:
    """Whether the innermost frames are torch.distributed waiting on other ranks."""
    return any("/torch/distributed/" in f for f, _, _ in frames[:12])


def _where(frames: list[tuple[str, int, str]]) -> str:
    file, line, func = frames[0]
    short = file.split("/site-packages/")[-1].split("/areal_cli/", 1)
    short = "areal_cli/" + short[1] if len(short) == 2 else short[0]
    return f"{short}:{line} in {func}"


def explain_trainer(ranks: tuple[Beat, ...], dumps: dict[str, str], now: float) -> str:
    """Which rank the others wait for, from their stacks; '' when the stacks do not say."""
    frames = {b.name: main_thread_frames(dumps.get(b.name, "")) for b in ranks}
    if not ranks or not all(frames.values()):
        return ""
    outside = [b for b in ranks if not in_collective(frames[b.name])]
    if not outside:
        return (
            "every rank waits inside a collective, so their collectives do not match "
            "(a bug: please report it with the stacks)"
        )
    inside = [b for b in ranks if b not in outside]
    parts = [
        f"rank {_rank(b)} is stuck outside any collective in '{b.phase}' "
        f"for {now - b.since:.0f} s (at {_where(frames[b.name])})"
        for b in outside
    ]
    them = "it" if len(outside) == 1 else "them"
    parts += [f"rank {_rank(b)} waits for {them} in a collective in '{b.phase}'" for b in inside]
    return "; ".join(parts)


# ------------------------------------------------------------------ the controller's task


async def watch(
    cfg: ExperimentConfig,
    run_dir: Path,
    client: Any,
    names: dict[str, str],
    describe_rollouts: Callable[[], str],
    poll_s: float = 1.0,
) -> None:
    """Check once every `poll_s`; raise RunStuck, naming what is stuck, when the run stops
    making progress. `client` is the controller's InferenceClient (its `activity()` and
    `health()`), or None for a role with no server; `names` maps server addresses to
    process names."""
    dog = ProgressWatchdog(cfg, time.time())
    while True:
        await asyncio.sleep(poll_s)
        beats = heartbeat.read_all(run_dir, "trainer-")
        servers = [
            ServerActivity(names[address], pending, last_done)
            for address, pending, last_done in (client.activity() if client else [])
        ]
        stuck = dog.check(beats, servers, time.time())
        if stuck is None:
            continue
        logs = RunDir(run_dir).logs
        if stuck.side == "trainer":
            dumps = await _stack_dumps(run_dir, stuck.ranks)
            explained = explain_trainer(stuck.ranks, dumps, time.time())
            raise RunStuck(
                f"{stuck.headline}: {explained or stuck.detail}. Stacks: "
                f"{RunDir(run_dir).heartbeat}/trainer-*.stack; log: {RunDir(run_dir).log('trainer')}"
            )
        health = await client.health() if client else {}
        down = [names[address] for address, ok in health.items() if not ok]
        sick = f"; not answering /health: {', '.join(down)}" if down else ""
        raise RunStuck(f"{stuck.message}{sick}; {describe_rollouts()}. Logs: {logs}")


async def _stack_dumps(
    run_dir: Path, ranks: tuple[Beat, ...], wait_s: float = 2.0
) -> dict[str, str]:
    """Ask each rank for its stacks (SIGUSR1) and return what each one wrote."""
    files = {b.name: heartbeat.stack_file(run_dir, b.name) for b in ranks}
    before = {name: _size(path) for name, path in files.items()}
    for beat in ranks:
        try:
            os.kill(beat.pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(
        _size(path) <= before[name] for name, path in files.items()
    ):
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.2)  # let the last dump finish
    dumps = {}
    for name, path in files.items():
        try:
            with open(path, errors="replace") as f:
                f.seek(before[name])
                dumps[name] = f.read()
        except OSError:
            dumps[name] = ""
    return dumps


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
