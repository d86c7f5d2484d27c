"""The weight sync of the rollout loop (areal_cli.rollout.sync), without processes: the real
InferenceClient talks to in-process HTTP servers on loopback that answer the SGLang routes
the sync uses (/update_weights_from_disk, /model_info, /health), and the weights entries are real
handoff entries in a real RUN/weights/."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from areal_cli.inference.client import InferenceClient, WeightUpdateFailed
from areal_cli.rollout.errors import RunFailed
from areal_cli.rollout.recovery import ServerRecovery
from areal_cli.rollout.state import LoopState
from areal_cli.rollout.sync import WeightSync
from areal_cli.rundir import handoff
from areal_cli.rundir.paths import RunDir, version_name
from tests.conftest import free_port


class SGLangRoutes:
    """The weight routes of one SGLang server: /update_weights_from_disk answers success
    and no version (as SGLang does); /model_info says the version it holds."""

    def __init__(self) -> None:
        self.version = "0"
        self.loaded: list[str] = []  # model paths, in the order they were loaded
        self.refuse: Callable[[str], None] | None = None  # answer success: false, after this
        self.ignore_version = False  # load, but keep reporting the old version
        self.says_version = False  # answer with the version (as the embedded server does)
        self.model_info_calls = 0

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.refuse is not None:
            self.refuse(body["model_path"])
            return web.json_response({"success": False, "message": "no such folder"})
        self.loaded.append(body["model_path"])
        if not self.ignore_version:
            self.version = str(body["weight_version"])
        answer: dict[str, Any] = {"success": True, "message": "ok", "num_paused_requests": 0}
        if self.says_version:
            answer["weight_version"] = self.version
        return web.json_response(answer)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def model_info(self, request: web.Request) -> web.Response:
        self.model_info_calls += 1
        return web.json_response({"model_path": "/m", "weight_version": self.version})


Routes = list[tuple[str, str, Callable[[web.Request], Awaitable[web.Response]]]]


@asynccontextmanager
async def serving(apps: list[Routes]) -> AsyncIterator[InferenceClient]:
    """One HTTP server on loopback per list of (method, path, handler), and a client over
    them (no retries)."""
    runners, addresses = [], []
    for routes in apps:
        app = web.Application()
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        addresses.append(f"http://127.0.0.1:{port}")
    client = InferenceClient(addresses, retries=0, timeout_s=10)
    try:
        yield client
    finally:
        await client.close()
        for runner in runners:
            await runner.cleanup()


@asynccontextmanager
async def loop_with_servers(n: int, run_dir: Path) -> AsyncIterator[tuple[WeightSync, list]]:
    """`n` servers on loopback, a client over them and a sync of a fresh loop (on v0)."""
    servers = [SGLangRoutes() for _ in range(n)]
    apps: list[Routes] = [
        [
            ("POST", "/update_weights_from_disk", routes.update_weights_from_disk),
            ("GET", "/model_info", routes.model_info),
            ("GET", "/health", routes.health),
        ]
        for routes in servers
    ]
    async with serving(apps) as client:
        state = LoopState(version=0, next_step=1)
        yield WeightSync(client, RunDir(run_dir).weights, state), servers


def publish(run_dir: Path, version: int) -> Path:
    """weights/vN as the trainer writes it (handoff protocol, manifest last)."""
    started = time.time()
    entry = handoff.write_entry(
        RunDir(run_dir).weights,
        version_name(version),
        version,
        lambda tmp: [handoff.write_bytes(tmp, "model.safetensors", b"w" * 64)],
        {"step": version, "publish_started": started},
    )
    return entry.path


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=30))


def test_a_new_version_is_loaded_on_every_server_and_moves_the_loop(tmp_path: Path) -> None:
    async def test() -> None:
        async with loop_with_servers(2, tmp_path) as (sync, servers):
            assert not await sync.load_newest()  # nothing published yet
            v1 = publish(tmp_path, 1)
            assert await sync.load_newest()
            assert [s.loaded for s in servers] == [[str(v1)], [str(v1)]]
            assert sync.state.version == 1 and sync.state.version_changed.is_set()
            figures = sync.state.handoff[1]
            assert set(figures) == {"handoff_load_s", "handoff_latency_s", "handoff_total_s"}
            assert 0 <= figures["handoff_load_s"] <= figures["handoff_total_s"]
            assert all(s.model_info_calls == 1 for s in servers)  # SGLang's answer has no version
            assert not await sync.load_newest()  # v1 is the newest

    run(test)


def test_a_version_overtaken_before_the_sync_looks_is_skipped(tmp_path: Path) -> None:
    async def test() -> None:
        async with loop_with_servers(2, tmp_path) as (sync, servers):
            publish(tmp_path, 2)
            v3 = publish(tmp_path, 3)
            assert await sync.load_newest()
            assert [s.loaded for s in servers] == [[str(v3)], [str(v3)]]  # v2 never loaded
            assert sync.state.version == 3
            assert set(sync.state.handoff) == {3}  # step 2's line has no load figures

    run(test)


def test_the_running_sync_loads_each_version_as_it_lands(tmp_path: Path) -> None:
    async def test() -> None:
        async with loop_with_servers(1, tmp_path) as (sync, servers):
            task = asyncio.create_task(sync.run(poll_s=0.5))
            try:
                for version in (1, 2):
                    path = publish(tmp_path, version)
                    while sync.state.version < version:
                        await asyncio.sleep(0.01)
                    assert servers[0].loaded[-1] == str(path)
            finally:
                task.cancel()
            assert servers[0].version == "2"

    run(test)


def test_a_server_that_says_its_version_is_not_asked_again(tmp_path: Path) -> None:
    async def test() -> None:
        async with loop_with_servers(2, tmp_path) as (sync, servers):
            for server in servers:
                server.says_version = True
            publish(tmp_path, 1)
            assert await sync.load_newest()
            assert sync.state.version == 1
            assert [s.model_info_calls for s in servers] == [0, 0]

    run(test)


def test_a_server_that_reports_another_version_fails_the_run(tmp_path: Path) -> None:
    async def test() -> None:
        async with loop_with_servers(2, tmp_path) as (sync, servers):
            servers[1].ignore_version = True
            publish(tmp_path, 1)
            with pytest.raises(RunFailed, match=r"versions \['0', '1'\] after loading v1"):
                await sync.load_newest()
            assert sync.state.version == 0  # the loop does not count the servers on v1

    run(test)


def test_a_refused_load_fails_unless_the_trainer_collected_the_entry(tmp_path: Path) -> None:
    async def test() -> None:
        async with loop_with_servers(1, tmp_path) as (sync, servers):
            publish(tmp_path, 1)
            servers[0].refuse = lambda path: None  # the entry is still there: a real refusal
            with pytest.raises(WeightUpdateFailed, match="refused weights"):
                await sync.load_newest()
            # the trainer collects v1 (v2 replaced it) while the server looks for it
            servers[0].refuse = lambda path: shutil.rmtree(path)
            assert await sync.load_newest()  # look again ...
            servers[0].refuse = None
            v2 = publish(tmp_path, 2)
            assert await sync.load_newest()  # ... and load the newer one
            assert servers[0].loaded == [str(v2)] and sync.state.version == 2

    run(test)


def test_a_restarted_server_comes_back_on_the_version_the_others_hold(tmp_path: Path) -> None:
    async def test() -> None:
        async with loop_with_servers(2, tmp_path) as (sync, servers):
            v1 = publish(tmp_path, 1)
            assert await sync.load_newest()
            recovery = ServerRecovery(sync.client, sync.weights_dir, sync.state, 5.0)
            address = sync.client.servers[1].address
            recovery.down(address)  # its process died; the launcher restarts it
            servers[1].version = "0"  # the new process starts from the initial model
            v2 = publish(tmp_path, 2)
            assert await sync.load_newest()  # the live server only
            assert servers[0].loaded == [str(v1), str(v2)] and servers[1].loaded == [str(v1)]
            assert await recovery.up(address, check=lambda: None) == 2
            assert servers[1].loaded == [str(v1), str(v2)] and servers[1].version == "2"
            assert not sync.client.servers[1].down and sync.state.version == 2

    run(test)
