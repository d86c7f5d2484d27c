"""The async client against real embedded servers (subprocesses on loopback) and a stub.

Two servers, labelled through their weight version ("a", "b"), show where each request
went. The stub server (in-process, no model) counts attempts to prove that 5xx is retried
and 4xx is not. The last test kills one real server.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from areal_cli.inference.backends import BACKENDS, ServeOptions
from areal_cli.inference.client import (
    ForeignServer,
    InferenceClient,
    RequestRejected,
    ServerUnavailable,
    WeightUpdateFailed,
)
from areal_cli.launch.local import ServerProcess, start_server
from tests.conftest import free_port

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def servers(
    tiny_model_dir: Path, tiny_model_dir_alt: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list]:
    logs = tmp_path_factory.mktemp("logs")
    roots = (str(tiny_model_dir_alt.parent), str(tmp_path_factory.getbasetemp()))

    def start(name: str) -> ServerProcess:
        port = free_port()
        options = ServeOptions(str(tiny_model_dir), port=port, weight_roots=roots)
        argv = BACKENDS["embedded"].serve_argv(options, sys.executable)
        return start_server(argv, logs / f"{name}.log", f"http://127.0.0.1:{port}", timeout_s=120)

    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(start, ["a", "b"]))
    try:
        yield started
    finally:
        for server in started:
            server.stop()


def label(servers: list[ServerProcess]) -> None:
    """Name each server by its weight version, so responses say who served them."""

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            for server, name in zip(servers, "ab", strict=False):
                body = {"new_version": name, "abort_all_requests": False}
                async with session.post(server.url + "/update_weight_version", json=body) as r:
                    assert r.status == 200

    run(main())


def client_for(servers: list[ServerProcess], **kw: Any) -> InferenceClient:
    logs = {s.url: s.log for s in servers}
    kw = {"timeout_s": 60, "retries": 2, "backoff_s": 0.05, **kw}
    return InferenceClient([s.url for s in servers], logs=logs, **kw)


def served_by(answers: list[dict]) -> list[str]:
    return [a["meta_info"]["weight_version"] for a in answers]


@pytest.mark.slow
def test_a_server_of_another_run_is_refused_by_name(
    servers: list[ServerProcess], tiny_model_dir: Path
) -> None:
    """A run's client takes only servers that serve its own name: one that holds the
    run's port but serves another name is ForeignServer, on start and on a restart."""

    async def main() -> None:
        async with client_for(servers, served_model="areal-run-0123") as client:
            with pytest.raises(ForeignServer) as err:
                await client.wait_healthy(30)
            port = servers[0].url.rsplit(":", 1)[1]
            assert f"another process holds port {port}" in str(err.value)
            assert f"it serves '{tiny_model_dir}'" in str(err.value)
            with pytest.raises(ForeignServer):
                await client.check_identity(servers[1].url)
        async with client_for(servers, served_model=str(tiny_model_dir)) as client:
            await client.wait_healthy(30)  # the name they serve: accepted

    run(main())


@pytest.mark.slow
def test_least_loaded_spreads_concurrent_requests(servers: list[ServerProcess]) -> None:
    label(servers)

    async def main() -> list[dict]:
        async with client_for(servers) as client:
            return await asyncio.gather(
                *(client.generate([5 + i, 6], GREEDY, rid=f"spread-{i}") for i in range(8))
            )

    answers = run(main())
    assert sorted(served_by(answers)) == ["a"] * 4 + ["b"] * 4
    assert all(len(a["output_ids"]) == 4 for a in answers)
    assert all(len(a["meta_info"]["output_token_logprobs"]) == 4 for a in answers)


@pytest.mark.slow
def test_round_robin_alternates(servers: list[ServerProcess]) -> None:
    label(servers)

    async def main() -> list[dict]:
        async with client_for(servers, policy="round_robin") as client:
            return [await client.generate([7, 8], GREEDY) for _ in range(4)]

    by = served_by(run(main()))
    assert by in (["a", "b", "a", "b"], ["b", "a", "b", "a"])


@pytest.mark.slow
def test_control_calls_reach_every_server(
    servers: list[ServerProcess], tiny_model_dir_alt: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        async with client_for(servers) as client:
            assert await client.health() == {s.url: True for s in servers}
            await client.wait_healthy(10)
            answers = await client.update_weights_from_disk(str(tiny_model_dir_alt), "v7")
            assert [a["success"] for a in answers] == [True, True]
            assert [i["weight_version"] for i in await client.model_info()] == ["v7", "v7"]
            with pytest.raises(WeightUpdateFailed) as err:
                await client.update_weights_from_disk(str(tmp_path / "missing"), "v8")
            assert all(s.url in str(err.value) for s in servers)
            assert "2 of 2 server(s) refused" in str(err.value)
            assert [i["weight_version"] for i in await client.model_info()] == ["v7", "v7"]
            await client.pause_generation("in_place")
            await client.continue_generation()
            assert [a["success"] for a in await client.abort_all()] == [True, True]
            assert len((await client.generate([9], GREEDY))["output_ids"]) == 4

    run(main())


@pytest.mark.slow
def test_bad_request_is_rejected_not_retried(servers: list[ServerProcess]) -> None:
    async def main() -> None:
        async with client_for(servers, retries=3, backoff_s=5) as client:
            start = time.monotonic()
            with pytest.raises(RequestRejected, match="HTTP 400.*unknown sampling params"):
                await client.generate([1, 2], {"bogus": 1})
            assert time.monotonic() - start < 3  # a retry would have slept 5 s first
            assert all(s.inflight == 0 for s in client.servers)

    run(main())


@pytest.mark.slow
def test_killed_server_retries_elsewhere_then_fails_clearly(
    servers: list[ServerProcess],
) -> None:
    """Runs last in this module: it stops server b."""
    label(servers)
    a, b = servers
    assert b.stop() == 0

    async def main() -> None:
        async with client_for(servers) as client:
            answers = await asyncio.gather(*(client.generate([3, i], GREEDY) for i in range(4)))
            assert served_by(answers) == ["a"] * 4
            assert await client.health() == {a.url: True, b.url: False}
            with pytest.raises(ServerUnavailable, match=f"{b.url} not healthy after 0.5s"):
                await client.wait_healthy(0.5, interval_s=0.1)
        async with client_for([b], retries=2) as alone:
            with pytest.raises(ServerUnavailable) as err:
                await alone.generate([3], GREEDY)
        assert str(err.value) == (
            f"server {b.url} is not answering (connection refused) after 2 retries; "
            f"check its log {b.log}"
        )

    run(main())


# --------------------------------------------------------------------------- stub server


class Stub:
    """An in-process HTTP server that fails the first `failures` calls with `status`."""

    def __init__(self, status: int, failures: int) -> None:
        self.status, self.failures, self.calls = status, failures, 0

    async def generate(self, request: web.Request) -> web.Response:
        self.calls += 1
        if self.calls <= self.failures:
            error = {"error": {"message": f"stub failure {self.calls}"}}
            return web.json_response(error, status=self.status)
        return web.json_response({"output_ids": [1], "auth": request.headers.get("Authorization")})


async def with_stub(stub: Stub, body: Any) -> Any:
    app = web.Application()
    app.router.add_post("/generate", stub.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        return await body(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def test_5xx_is_retried_with_auth_header() -> None:
    stub = Stub(503, failures=2)

    async def body(url: str) -> dict:
        async with InferenceClient([url], api_key="k", retries=2, backoff_s=0.01) as client:
            return await client.generate([1], {})

    assert run(with_stub(stub, body)) == {"output_ids": [1], "auth": "Bearer k"}
    assert stub.calls == 3


def test_5xx_exhausts_retries_with_the_servers_message() -> None:
    stub = Stub(500, failures=10)

    async def body(url: str) -> None:
        async with InferenceClient([url], retries=1, backoff_s=0.01) as client:
            with pytest.raises(
                ServerUnavailable, match=r"HTTP 500: stub failure 2\) after 1 retry"
            ):
                await client.generate([1], {})

    run(with_stub(stub, body))
    assert stub.calls == 2


def test_4xx_is_not_retried() -> None:
    stub = Stub(422, failures=10)

    async def body(url: str) -> None:
        async with InferenceClient([url], retries=3, backoff_s=0.01) as client:
            with pytest.raises(RequestRejected, match="HTTP 422: stub failure 1") as err:
                await client.generate([1], {})
            assert err.value.status == 422

    run(with_stub(stub, body))
    assert stub.calls == 1


class ClosesIdleConnections:
    """A raw HTTP/1.1 server that answers with keep-alive, but closes a connection,
    without answering, when a request arrives on it after `idle_s` of silence: what
    uvicorn (SGLang's and vLLM's server) does when its idle timer fires as a request
    comes in."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s, self.connections = idle_s, 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        last = None
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")), 0,
                )  # fmt: skip
                await reader.readexactly(length)
                if last is not None and time.monotonic() - last >= self.idle_s:
                    break  # closed as the request arrives
                body = b'{"output_ids": [1]}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                last = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def test_a_connection_idle_past_the_servers_keep_alive_is_not_reused(monkeypatch) -> None:
    """The client reuses a pooled connection only while it is younger than KEEPALIVE_S,
    which stays below uvicorn's 5 s: a call never goes out on a connection that the
    server is closing. Here at scale: the server closes after 0.3 s idle, the client
    keeps connections 0.2 s; one attempt per call, so a reused dead one would fail it."""
    import areal_cli.inference.client as client_module

    assert client_module.KEEPALIVE_S < 5.0
    monkeypatch.setattr(client_module, "KEEPALIVE_S", 0.2)
    stub = ClosesIdleConnections(idle_s=0.3)

    async def body() -> list:
        server = await asyncio.start_server(stub.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with InferenceClient([f"http://127.0.0.1:{port}"], retries=0) as client:
                got = [await client.generate([1], {}), await client.generate([1], {})]
                await asyncio.sleep(0.5)  # idle past both limits
                got.append(await client.generate([1], {}))
                return got
        finally:
            server.close()

    assert run(body()) == [{"output_ids": [1]}] * 3
    assert stub.connections == 2  # the two quick calls shared one; the late one had its own


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="at least one"):
        InferenceClient([])
    with pytest.raises(ValueError, match="policy"):
        InferenceClient(["http://x"], policy="random")  # type: ignore[arg-type]


def test_a_server_taken_down_is_waited_for_and_its_failed_attempts_reissued() -> None:
    """While the controller restarts a server (set_down .. set_up), a request that failed
    on it waits instead of using up its retries, and control calls skip it."""
    stub = Stub(503, failures=10)

    async def body(url: str) -> dict:
        async with InferenceClient([url], retries=1, backoff_s=0.5) as client:
            request = asyncio.ensure_future(client.generate([1], {}))
            while stub.calls < 1:
                await asyncio.sleep(0.01)
            client.set_down(url)  # the controller saw the process die
            assert not client.any_up() and await client.model_info() == []
            await asyncio.sleep(1.0)  # two backoffs: retries=1 alone would have failed
            assert not request.done() and stub.calls == 1
            stub.failures = 0  # the new process answers
            client.set_up(url)
            answer = await request
            assert client.reissued == 1
            return answer

    assert run(with_stub(stub, body))["output_ids"] == [1]
    assert stub.calls == 2


@pytest.mark.slow
def test_the_busy_clock_counts_overlapping_calls_once(servers: list[ServerProcess]) -> None:
    """busy_s is the time at least one /generate call was in flight; generated_tokens
    counts the answered output tokens (what gen_tokens_per_s divides)."""

    async def main() -> tuple[float, float, float, int]:
        async with client_for(servers) as client:
            start = time.monotonic()
            await asyncio.gather(*(client.generate([5 + i, 6], GREEDY) for i in range(8)))
            wall = time.monotonic() - start
            idle_from = client.busy_s()
            await asyncio.sleep(0.3)  # nothing in flight: the clock stands still
            return client.busy_s(), idle_from, wall, client.generated_tokens

    busy, idle_from, wall, tokens = run(main())
    assert 0 < busy <= wall and busy == idle_from
    assert tokens == 8 * 4
