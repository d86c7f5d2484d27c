"""Subprocess agents (`rollout.mode: subproc`, AReaL's subproc mode): each agent episode
runs in one of `rollout.subproc_max_workers` worker processes, so an agent that blocks
(a synchronous SDK, `time.sleep`, a CPU-heavy tool, a library that is not async) cannot
stall the controller's event loop, its watchdog included.

A worker is `python -m areal_cli.rollout.subproc RECIPE_DIR SPEC`: it loads the agent
once, then runs one episode at a time. The protocol is one JSON line each way on its
stdin and a private copy of its stdout (the agent's own prints go to stderr, into the
controller's log):
  controller -> worker   {"data": <row>, "base_url": ..., "api_key": ...}
  worker -> controller   {"ready": true} once loaded (or {"error": ...} if it is not),
                         then per episode {"reward": <float or {id: reward}>} or
                         {"error": "Type: message"}.
Before each episode the worker sets OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL
(without /v1) and ANTHROPIC_API_KEY, as AReaL does, so `OpenAI()` and `Anthropic()` with
no arguments reach the episode; `run` also gets base_url and api_key as kwargs (no
http_client: it cannot cross a process). `run` may be synchronous here; an async one runs
under its own `asyncio.run`.

Faults, each the episode's only: an agent that raises is an error (agent_errors); one
that runs past `rollout.agent_timeout_s` (a hang) is killed with its worker
(agent_timeouts); a worker that dies under it (os._exit, a segfault, the OOM killer) is a
crash (agent_crashes). A killed or dead worker is replaced by a new one. Time spent
waiting for a free worker does not count towards the timeout.

Pure standard library at import: the worker starts without torch or aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_cli.rundir.process import die_with, spawner_pid

START_TIMEOUT_S = 120.0  # a worker's import of the agent's module
EXIT_WAIT_S = 5.0  # a worker whose stdout closed, before it is killed


class AgentFailed(RuntimeError):
    """The agent raised (its type and message)."""


class AgentCrashed(RuntimeError):
    """The worker died while it ran the agent."""


class PoolBroken(RuntimeError):
    """A worker could not be started: the run cannot go on."""


def _worker_env(base_url: str, api_key: str) -> dict[str, str]:
    return {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": api_key,
    }


@dataclass(eq=False)  # workers are kept in sets, by identity
class _Worker:
    process: asyncio.subprocess.Process

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message, default=str).encode() + b"\n")
        await self.process.stdin.drain()

    async def receive(self) -> dict[str, Any] | None:
        """The worker's next line, or None when it died (its stdout closed)."""
        assert self.process.stdout is not None
        line = await self.process.stdout.readline()
        return json.loads(line) if line else None

    async def kill(self) -> int | None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        return await self.process.wait()

    async def exit_code(self) -> int | None:
        """The exit code of a worker whose stdout closed (it is dying), killed if it has
        not exited within EXIT_WAIT_S. Not killed first: Popen.kill polls the process and
        can reap it before asyncio's watcher does, which then reports 255 for any code."""
        try:
            return await asyncio.wait_for(self.process.wait(), EXIT_WAIT_S)
        except TimeoutError:
            return await self.kill()


class AgentPool:
    """`workers` agent processes; `run` hands an episode to a free one."""

    def __init__(self, spec: str, recipe_dir: Path, workers: int) -> None:
        self.spec, self.recipe_dir, self.size = spec, recipe_dir, workers
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._spawning: set[asyncio.Task[None]] = set()
        self._broken: BaseException | None = None
        self.crashes = 0
        self.replaced = 0

    async def start(self) -> None:
        """Start every worker and wait until each has loaded the agent."""
        try:
            await asyncio.gather(*(self._spawn() for _ in range(self.size)))
        except BaseException:
            await self.close()
            raise

    async def _spawn(self) -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "areal_cli.rollout.subproc", str(self.recipe_dir), self.spec,
            str(spawner_pid()),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=64 * 1024 * 1024,
        )  # fmt: skip
        worker = _Worker(process)
        self._all.add(worker)
        try:
            hello = await asyncio.wait_for(worker.receive(), START_TIMEOUT_S)
        except TimeoutError:
            hello = {"error": f"it did not load the agent in {START_TIMEOUT_S:g} s"}
        if not hello or not hello.get("ready"):
            self._all.discard(worker)
            code = await (worker.exit_code() if hello is None else worker.kill())
            said = (hello or {}).get("error") or f"it exited with code {code}"
            self._broken = PoolBroken(f"a worker for the agent {self.spec} failed to start: {said}")
            raise self._broken
        self._idle.put_nowait(worker)

    def _replace(self, worker: _Worker) -> None:
        """Drop `worker` (dead or killed) and start another in the background."""
        self._all.discard(worker)
        self.replaced += 1
        task = asyncio.ensure_future(self._spawn())
        self._spawning.add(task)
        task.add_done_callback(self._spawned)

    def _spawned(self, task: asyncio.Task[None]) -> None:
        self._spawning.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._broken = task.exception()

    async def run(self, data: dict[str, Any], base_url: str, api_key: str, timeout_s: float):
        """The agent's reward for one episode; AgentFailed, AgentCrashed or TimeoutError
        for its faults (the worker is then replaced), PoolBroken when none can start."""
        if self._broken is not None:
            raise self._broken
        worker = await self._idle.get()
        try:
            await worker.send({"data": data, "base_url": base_url, "api_key": api_key})
            answer = await asyncio.wait_for(worker.receive(), timeout_s)
        except TimeoutError:
            await worker.kill()  # a hung agent is stopped with its worker
            self._replace(worker)
            raise
        except asyncio.CancelledError:  # the run is ending: stop the worker, start none
            self._all.discard(worker)
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()
            raise
        except (ConnectionError, BrokenPipeError):
            answer = None
        if answer is None:
            code = await worker.exit_code()
            self.crashes += 1
            self._replace(worker)
            raise AgentCrashed(f"its worker died (exit code {code})")
        self._idle.put_nowait(worker)
        if "error" in answer:
            raise AgentFailed(answer["error"])
        return answer.get("reward")

    async def close(self) -> None:
        for task in list(self._spawning):
            task.cancel()
        await asyncio.gather(*self._spawning, return_exceptions=True)
        await asyncio.gather(*(w.kill() for w in list(self._all)), return_exceptions=True)
        self._all.clear()


def _plain(value: Any) -> Any:
    """A reward the agent returned, as JSON can carry it (numpy numbers become floats)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (bool, str)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def _worker_main(recipe_dir: str, spec: str) -> None:
    """A worker: load the agent, then run episodes read from stdin until it closes."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the agent's prints go to stderr, never into the protocol
    sys.stdout = sys.stderr

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")

    from areal_cli.config.recipe_code import load_agent

    try:
        make = load_agent(spec, Path(recipe_dir), sync_ok=True)
    except Exception as err:  # noqa: BLE001 - said to the controller, which stops the run
        say({"error": f"{type(err).__name__}: {err}"})
        return
    say({"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        os.environ.update(_worker_env(job["base_url"], job["api_key"]))
        try:
            result = make()(job["data"], base_url=job["base_url"], api_key=job["api_key"])
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            say({"reward": _plain(result)})
        except Exception as err:  # noqa: BLE001 - the episode's failure, counted there
            say({"error": f"{type(err).__name__}: {err}"})


async def _awaited(result: Any) -> Any:
    return await result


if __name__ == "__main__":
    die_with(int(sys.argv[3]))  # an agent busy in an episode must not outlive a killed controller
    _worker_main(sys.argv[1], sys.argv[2])
