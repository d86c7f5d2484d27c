"""Subprocess agents (rollout.mode: subproc): real worker processes run a synchronous
agent while the controller's event loop keeps running; an error, a hang and a crash are
each one episode's fault, counted by name, and the worker is replaced."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from areal_cli.config.recipe_code import agent_problem
from areal_cli.rollout.agents import AgentRunner
from areal_cli.rollout.proxy import AgentProxy, ProxySettings
from areal_cli.rollout.subproc import AgentCrashed, AgentFailed, AgentPool, PoolBroken
from tests.unit.test_rewards import worker_outlives

pytestmark = pytest.mark.slow

AGENT = """
import os, time

class Sync:
    def run(self, data, **kwargs):
        print("agents may print; the protocol is elsewhere")
        if data.get("sleep"):
            time.sleep(data["sleep"])
        if data.get("raise"):
            raise ValueError("no such tool")
        if data.get("exit"):
            os._exit(data["exit"])
        assert kwargs["base_url"] == os.environ["OPENAI_BASE_URL"]
        return {"reward": data["x"] * 2, "env": os.environ["ANTHROPIC_BASE_URL"]}["reward"]

async def coro(data, **kwargs):
    return 0.5

def plain(data, **kwargs):
    return {"c1": 1.0}
"""


@pytest.fixture
def agent_dir(tmp_path: Path) -> Path:
    (tmp_path / "myagent.py").write_text(AGENT)
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    return tmp_path


def _run(coro):
    return asyncio.run(coro)


def test_a_synchronous_agent_runs_in_workers_without_stalling_the_loop(agent_dir: Path) -> None:
    async def go() -> tuple[list, int]:
        pool = AgentPool("myagent:Sync", agent_dir, 2)
        await pool.start()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        tick = asyncio.create_task(ticker())
        try:
            url = "http://127.0.0.1:9/e/x/v1"
            # two workers, three 1-second episodes: the third waits for a free worker
            started = time.monotonic()
            rewards = await asyncio.gather(
                *(pool.run({"x": i, "sleep": 1.0}, url, "k", 30) for i in range(3))
            )
            took = time.monotonic() - started
        finally:
            tick.cancel()
            await pool.close()
        assert 2.0 <= took < 5.0
        return rewards, ticks

    rewards, ticks = _run(go())
    assert rewards == [0.0, 2.0, 4.0]
    assert ticks >= 25  # the loop ran on while the agents slept in their workers


def test_errors_hangs_and_crashes_are_the_episodes_and_workers_are_replaced(
    agent_dir: Path,
) -> None:
    async def go() -> None:
        pool = AgentPool("myagent:Sync", agent_dir, 1)
        await pool.start()
        url = "http://127.0.0.1:9/v1"
        try:
            with pytest.raises(AgentFailed, match="ValueError: no such tool"):
                await pool.run({"raise": True}, url, "k", 30)
            assert await pool.run({"x": 1}, url, "k", 30) == 2.0  # the same worker goes on
            with pytest.raises(TimeoutError):
                await pool.run({"sleep": 60}, url, "k", 1.0)
            assert await pool.run({"x": 2}, url, "k", 30) == 4.0  # a new worker took over
            with pytest.raises(AgentCrashed, match="exit code 7"):
                await pool.run({"exit": 7}, url, "k", 30)
            assert await pool.run({"x": 3}, url, "k", 30) == 6.0
            assert (pool.crashes, pool.replaced) == (1, 2)
        finally:
            await pool.close()

    _run(go())


def test_a_busy_worker_dies_with_a_controller_killed_with_9(agent_dir: Path) -> None:
    """An agent in the middle of an episode must not keep running after its controller
    was killed with -9."""
    driver = f"""
import asyncio
from areal_cli.rollout.subproc import AgentPool

async def main():
    pool = AgentPool("myagent:Sync", {str(agent_dir)!r}, 1)
    await pool.start()
    (worker,) = pool._all
    print(worker.process.pid, flush=True)
    await pool.run({{"sleep": 60}}, "http://127.0.0.1:9/v1", "k", 600)

asyncio.run(main())
"""
    assert not worker_outlives(driver, agent_dir)


def test_async_agents_and_functions_run_in_workers_too(agent_dir: Path) -> None:
    async def go() -> list:
        out = []
        for spec in ("myagent:coro", "myagent:plain"):
            pool = AgentPool(spec, agent_dir, 1)
            await pool.start()
            try:
                out.append(await pool.run({}, "http://127.0.0.1:9/v1", "k", 30))
            finally:
                await pool.close()
        return out

    assert _run(go()) == [0.5, {"c1": 1.0}]


def test_a_worker_that_cannot_load_the_agent_stops_the_run_by_name(agent_dir: Path) -> None:
    async def go() -> None:
        pool = AgentPool("broken:Agent", agent_dir, 2)
        await pool.start()

    with pytest.raises(PoolBroken, match="No module named 'no_such_module_here'"):
        _run(go())


def test_synchronous_agents_are_refused_inline_and_taken_in_subproc(agent_dir: Path) -> None:
    said = agent_problem("myagent:Sync", agent_dir)
    assert said is not None and "rollout.mode: subproc" in said
    assert agent_problem("myagent:Sync", agent_dir, sync_ok=True) is None


class _Seeds:
    def next_seed(self) -> int:
        return 0


def test_the_runner_counts_each_fault_by_name(agent_dir: Path) -> None:
    async def go() -> list[dict[str, float]]:
        proxy = AgentProxy(ProxySettings(), None, None, {})  # no request reaches it
        pool = AgentPool("myagent:Sync", agent_dir, 1)
        await pool.start()
        runner = AgentRunner(proxy, lambda: None, timeout_s=1.0, pool=pool)
        try:
            rows = ({"raise": True}, {"sleep": 60}, {"exit": 3}, {"x": 1})
            outcomes = [await runner.episode(_Seeds(), {"row": row}) for row in rows]
        finally:
            await pool.close()
        assert runner.ended == {"errors": 1, "timeouts": 1, "crashes": 1}
        assert "1 raised, 1 timed out and 1 crashed" in runner.describe()
        assert "in 1 worker processes" in runner.describe()
        return [o.counters for o in outcomes]

    counters = _run(go())
    assert counters[0]["agent_errors"] == 1.0
    assert counters[1]["agent_timeouts"] == 1.0
    assert counters[2]["agent_crashes"] == 1.0
    assert counters[3] == {"agent_episodes": 1.0, "agent_completions": 0.0, "agent_empty": 1.0}
