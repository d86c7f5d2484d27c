"""Online mode's session routes (rollout.mode: online) on a real agent proxy in front of a
real embedded server (the parrot): keys, 401s and 404s, groups filled by task_id, 429
while no slot is free, rewards by id and through turns, and sessions that time out."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from areal_cli.inference.client import InferenceClient
from areal_cli.rollout.online import OnlineSessions, SessionSettings
from areal_cli.rollout.proxy import AgentProxy, ProxySettings
from tests.inference.parrot import ASK_TEXT
from tests.inference.test_server import Server

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"


def _online(server: Server, parrot: Path, body, slow_s: float = 0.0, **settings: Any) -> Any:
    """Run `body(sessions, http)` with an online proxy in front of the server, whose
    answers come `slow_s` late (a loaded or paused server)."""

    async def go() -> Any:
        client = InferenceClient([server.url], backend="embedded", retries=0)

        async def generate(ids: list[int], params: dict) -> dict:
            await asyncio.sleep(slow_s)
            return await client.generate(ids, params)

        proxy = AgentProxy(
            ProxySettings(tool_parser="hermes", served_model="parrot"),
            AutoTokenizer.from_pretrained(parrot),
            generate,
            {"temperature": 0.0, "max_new_tokens": 16},
        )
        options = {"group_size": 2, "timeout_s": 60.0, "admin_key": ADMIN, **settings}
        sessions = OnlineSessions(proxy, SessionSettings(**options), version=lambda: 3)
        await proxy.start()
        try:
            async with httpx.AsyncClient(base_url=proxy.address, timeout=60) as http:
                return await body(sessions, http)
        finally:
            await proxy.close()
            await client.close()

    return asyncio.run(go())


def _key(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _start(http: httpx.AsyncClient, task: str | None = None, **extra: Any) -> dict:
    body = {"task_id": task, **extra} if task is not None else extra
    answer = await http.post("/rl/start_session", json=body, headers=_key(ADMIN))
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_keys_guard_every_route_and_an_ended_session_is_gone(server: Server, parrot: Path):
    async def body(sessions: OnlineSessions, http: httpx.AsyncClient) -> None:
        group = asyncio.ensure_future(sessions.group(0, 3))
        await asyncio.sleep(0)
        assert (await http.post("/rl/start_session", json={})).status_code == 401
        wrong = await http.post("/rl/start_session", json={}, headers=_key("nope"))
        assert wrong.status_code == 401 and "admin key" in wrong.json()["error"]["message"]
        started = await _start(http, "q1")
        key = started["api_key"]
        assert key.startswith("sk-sess-") and started["base_url"].endswith("/v1")
        sdk = openai.AsyncOpenAI(base_url=started["base_url"], api_key=key, max_retries=0)
        reply = await sdk.chat.completions.create(model="m", messages=ASK_TEXT)
        assert reply.usage.completion_tokens > 0 and reply.id.startswith("chatcmpl-")
        stranger = openai.AsyncOpenAI(base_url=started["base_url"], api_key="sk-sess-x")
        with pytest.raises(openai.AuthenticationError):
            await stranger.chat.completions.create(model="m", messages=ASK_TEXT)
        with pytest.raises(openai.AuthenticationError):  # the admin key is no session key
            await openai.AsyncOpenAI(
                base_url=started["base_url"], api_key=ADMIN
            ).chat.completions.create(model="m", messages=ASK_TEXT)
        # AReaL's gateway paths, without /v1, answer too
        plain = await http.post("/chat/completions", json={"messages": ASK_TEXT}, headers=_key(key))
        assert plain.status_code == 200
        bad_id = await http.post(
            "/rl/set_reward", json={"reward": 1, "interaction_id": "x"}, headers=_key(key)
        )
        assert bad_id.status_code == 400 and "'x' is no completion" in bad_id.text
        first = await http.post(
            "/rl/set_reward", json={"reward": 0.25, "interaction_id": reply.id}, headers=_key(key)
        )
        assert first.json()["interaction_id"] == reply.id
        assert (
            await http.post("/rl/set_reward", json={"reward": 1.0}, headers=_key(key))
        ).is_success
        assert (await http.post("/rl/end_session", json={}, headers=_key(key))).is_success
        late = await http.post("/rl/set_reward", json={"reward": 1.0}, headers=_key(key))
        assert late.status_code == 404 and "has ended" in late.text
        assert (await http.post("/rl/end_session", headers=_key(key))).status_code == 404
        with pytest.raises(openai.NotFoundError):
            await sdk.chat.completions.create(model="m", messages=ASK_TEXT)
        other = await _start(http, "q1")  # the group's second slot
        assert (
            await http.post("/rl/end_session", json={}, headers=_key(other["api_key"]))
        ).is_success
        done = await group
        assert done.start_version == 3 and done.prompt_index == 0
        assert [t.reward for t in done.trajectories] == [0.25, 1.0]  # by id, and the last
        assert done.counters["online_sessions"] == 2 and done.counters["online_empty"] == 1
        await sdk.close()

    _online(server, parrot, body)


def test_sessions_fill_groups_by_task_and_wait_for_a_free_slot(server: Server, parrot: Path):
    async def body(sessions: OnlineSessions, http: httpx.AsyncClient) -> None:
        groups = [asyncio.ensure_future(sessions.group(i, 0)) for i in range(2)]
        await asyncio.sleep(0)
        a, b, c = await _start(http, "x"), await _start(http, "y"), await _start(http, "x")
        assert [s.id for s in sessions.groups[0].sessions] == [a["session_id"], c["session_id"]]
        full = await http.post("/rl/start_session", json={"task_id": "z"}, headers=_key(ADMIN))
        assert full.status_code == 429 and full.headers["Retry-After"] == "1"
        d = await _start(http, "y")
        for s in (a, b, c, d):
            await http.post("/chat/completions", json={"messages": ASK_TEXT}, headers=_key(s["api_key"]))  # fmt: skip
            await http.post("/rl/set_reward", json={"reward": 1}, headers=_key(s["api_key"]))
            await http.post("/rl/end_session", headers=_key(s["api_key"]))
        done = await asyncio.gather(*groups)
        assert [len(g.trajectories) for g in done] == [2, 2]
        # a refresh: the key's open session ends and a new one takes the same key
        g3 = asyncio.ensure_future(sessions.group(2, 0))
        await asyncio.sleep(0)
        e = await _start(http)
        again = await _start(http, api_key=e["api_key"])
        assert again["api_key"] == e["api_key"] and again["session_id"] != e["session_id"]
        assert sessions.by_key[e["api_key"]].id == again["session_id"]
        await http.post("/rl/end_session", headers=_key(e["api_key"]))
        assert (await g3).counters["online_sessions"] == 2

    _online(server, parrot, body)


def test_silent_sessions_time_out_and_groups_close_with_what_they_have(
    server: Server, parrot: Path
) -> None:
    async def body(sessions: OnlineSessions, http: httpx.AsyncClient) -> None:
        watch = asyncio.ensure_future(sessions.watch(period_s=0.05))
        groups = [asyncio.ensure_future(sessions.group(i, 0)) for i in range(2)]
        await asyncio.sleep(0)
        silent = await _start(http, "a")  # never heard from again
        talker = await _start(http, "a")
        lonely = await _start(http, "b")  # its group's second slot is never taken
        for s in (talker, lonely):
            await http.post("/chat/completions", json={"messages": ASK_TEXT}, headers=_key(s["api_key"]))  # fmt: skip
            await http.post("/rl/set_reward", json={"reward": 1}, headers=_key(s["api_key"]))
            await http.post("/rl/end_session", headers=_key(s["api_key"]))
        first, second = await asyncio.wait_for(asyncio.gather(*groups), 10)
        assert sessions.by_key[silent["api_key"]].state == "timeout"
        assert first.counters["online_timeouts"] == 1 and len(first.trajectories) == 1
        assert second.counters["online_unfilled"] == 1 and len(second.trajectories) == 1
        late = await http.post(
            "/rl/set_reward", json={"reward": 1}, headers=_key(silent["api_key"])
        )
        assert late.status_code == 404 and "timeout" in late.text
        assert sessions.summary(3) == {
            "started": 3, "ended": 2, "timed_out": 1, "open_at_end": 0,
            "counted_in_steps": 3, "after_last_batch": 0,
        }  # fmt: skip
        await asyncio.sleep(0.8)  # another timeout on, the key is forgotten: 401
        gone = await http.post(
            "/rl/set_reward", json={"reward": 1}, headers=_key(silent["api_key"])
        )
        assert gone.status_code == 401
        watch.cancel()

    _online(server, parrot, body, timeout_s=0.5)


def test_a_session_waiting_for_a_slow_answer_is_not_idle(server: Server, parrot: Path) -> None:
    """Answers take 3 timeouts: the session lives through them, and its idle clock starts
    from the answer, not from the request."""

    async def body(sessions: OnlineSessions, http: httpx.AsyncClient) -> None:
        watch = asyncio.ensure_future(sessions.watch(period_s=0.05))
        group = asyncio.ensure_future(sessions.group(0, 0))
        await asyncio.sleep(0)
        key = _key((await _start(http, "a"))["api_key"])
        for _ in range(2):
            reply = await http.post("/chat/completions", json={"messages": ASK_TEXT}, headers=key)  # fmt: skip
            assert reply.status_code == 200, reply.text
        await asyncio.sleep(0.4)  # idle, but less than the timeout since the answer
        assert (await http.post("/rl/set_reward", json={"reward": 1}, headers=key)).status_code == 200  # fmt: skip
        assert (await http.post("/rl/end_session", headers=key)).status_code == 200
        done = await asyncio.wait_for(group, 10)
        assert done.counters["online_timeouts"] == 0 and done.counters["agent_completions"] == 2
        assert [t.reward for t in done.trajectories] == [1.0, 1.0]  # two prompts, no prefix
        watch.cancel()

    _online(server, parrot, body, slow_s=3.0, group_size=1, timeout_s=1.0)


def test_a_session_sending_a_slow_request_is_not_idle(server: Server, parrot: Path) -> None:
    """set_reward's body arrives 3 timeouts after its headers: the session is busy from the
    headers on, so the reward counts (it did not time out under the request and answer a
    400 for a completion the timeout had cleared)."""

    async def body(sessions: OnlineSessions, http: httpx.AsyncClient) -> None:
        watch = asyncio.ensure_future(sessions.watch(period_s=0.05))
        group = asyncio.ensure_future(sessions.group(0, 0))
        await asyncio.sleep(0)
        key = (await _start(http, "a"))["api_key"]
        reply = await http.post("/chat/completions", json={"messages": ASK_TEXT}, headers=_key(key))  # fmt: skip
        assert reply.status_code == 200, reply.text
        payload = b'{"reward": 1}'
        host, port = sessions.proxy.address.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /rl/set_reward HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        )
        await writer.drain()
        await asyncio.sleep(3.0)  # the body comes late
        writer.write(payload)
        await writer.drain()
        status = (await reader.readline()).decode()
        writer.close()
        assert " 200 " in status, status
        assert (await http.post("/rl/end_session", headers=_key(key))).status_code == 200
        done = await asyncio.wait_for(group, 10)
        assert done.counters["online_timeouts"] == 0 and [t.reward for t in done.trajectories] == [1.0]  # fmt: skip
        watch.cancel()

    _online(server, parrot, body, group_size=1, timeout_s=1.0)


def test_turns_pass_the_reward_back_by_the_discount(server: Server, parrot: Path) -> None:
    async def body(sessions: OnlineSessions, http: httpx.AsyncClient) -> list[float]:
        group = asyncio.ensure_future(sessions.group(0, 0))
        await asyncio.sleep(0)
        s = await _start(http, "t")
        messages = list(ASK_TEXT)
        for _ in range(3):
            reply = await http.post("/v1/chat/completions", json={"messages": messages}, headers=_key(s["api_key"]))  # fmt: skip
            messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
        await http.post("/rl/set_reward", json={"reward": 1.0}, headers=_key(s["api_key"]))
        await http.post("/rl/end_session", headers=_key(s["api_key"]))
        done = await group
        assert done.counters["agent_completions"] == 3
        return [t.reward for t in done.trajectories]

    rewards = _online(server, parrot, body, group_size=1, samples="individual", turn_discount=0.5)
    assert rewards == [0.25, 0.5, 1.0]
