"""The agent proxy in front of a real embedded server, driven by the real `openai` SDK.

The server runs the "parrot" (tests/inference/parrot.py): the tiny model fine-tuned to answer
three fixed conversations with fixed replies under greedy decoding (a well-formed tool
call, a malformed one, and plain text). So a tools request meets a reply that a model
really generated, not one the test wrote into the answer.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from areal_cli.inference.client import InferenceClient
from areal_cli.rollout.agents import AgentRunner
from areal_cli.rollout.batch import _pack
from areal_cli.rollout.proxy import AgentProxy, ProxySettings
from areal_cli.rollout.state import Group
from areal_cli.rollout.workflows import EpisodeClient
from tests.inference.parrot import (
    ASK_BROKEN,
    ASK_TEXT,
    ASK_TOOL,
    BROKEN_REPLY,
    CALC,
    TEXT_REPLY,
)
from tests.inference.test_server import Server

pytestmark = pytest.mark.slow


def _with_proxy(server: Server, parrot: Path, body, **settings: Any) -> Any:
    """Run `body(proxy, client)` with a proxy started in front of the server."""
    from transformers import AutoTokenizer

    async def go() -> Any:
        client = InferenceClient([server.url], backend="embedded", retries=0)
        proxy = AgentProxy(
            ProxySettings(tool_parser="hermes", served_model="parrot", **settings),
            AutoTokenizer.from_pretrained(parrot),
            lambda ids, params: client.generate(ids, params),
            {"temperature": 1.0, "max_new_tokens": 160},
        )
        await proxy.start()
        try:
            return await body(proxy, client)
        finally:
            await proxy.close()
            await client.close()

    return asyncio.run(go())


def test_the_openai_sdk_gets_tool_calls_streams_and_plain_text(server: Server, parrot: Path):
    async def body(proxy: AgentProxy, _client: Any) -> None:
        episode = proxy.open_episode(seed=7)
        sdk = openai.AsyncOpenAI(base_url=proxy.base_url(episode), api_key="unused")
        called = await sdk.chat.completions.create(
            model="anything", messages=ASK_TOOL, tools=[CALC], temperature=0
        )
        choice = called.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {
            "a": 12,
            "b": 34,
        }
        # the tool's answer goes back; the next request extends the conversation
        history = ASK_TOOL + [choice.message.model_dump(exclude_none=True)]
        history.append({"role": "tool", "tool_call_id": call.id, "content": "46"})
        await sdk.chat.completions.create(
            model="x", messages=history, tools=[CALC], temperature=0, max_tokens=4
        )
        broken = await sdk.chat.completions.create(
            model="x", messages=ASK_BROKEN, tools=[CALC], temperature=0
        )
        assert broken.choices[0].finish_reason == "stop"
        assert broken.choices[0].message.tool_calls is None
        assert broken.choices[0].message.content == BROKEN_REPLY
        plain = await sdk.chat.completions.create(
            model="x", messages=ASK_TEXT, tools=[CALC], temperature=0
        )
        assert plain.choices[0].message.content == TEXT_REPLY
        stream = await sdk.chat.completions.create(
            model="x", messages=ASK_TEXT, tools=[CALC], temperature=0, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == TEXT_REPLY
        streamed_call = await sdk.chat.completions.create(
            model="x", messages=ASK_TOOL, tools=[CALC], temperature=0, stream=True
        )
        deltas = [c.choices[0] async for c in streamed_call]
        assert deltas[-1].finish_reason == "tool_calls"
        assert any(d.delta.tool_calls for d in deltas)
        models = await sdk.models.list()
        assert [m.id for m in models.data] == ["parrot"]
        records = proxy.close_episode(episode)
        assert len(records) == 6 and records[0].id == called.id
        # the second request's prompt extends the first's prompt and reply
        first = records[0]
        assert records[1].prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == (
            first.prompt_ids + first.output_ids
        )
        with pytest.raises(openai.NotFoundError):  # the episode is over
            await sdk.chat.completions.create(model="x", messages=ASK_TEXT)
        await sdk.close()

    _with_proxy(server, parrot, body)


def test_bad_requests_are_named(server: Server, parrot: Path) -> None:
    async def body(proxy: AgentProxy, _client: Any) -> None:
        episode = proxy.open_episode(seed=1)
        sdk = openai.AsyncOpenAI(base_url=proxy.base_url(episode), api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="'n' above 1"):
            await sdk.chat.completions.create(model="x", messages=ASK_TEXT, n=2)
        with pytest.raises(openai.BadRequestError, match="'functions' is not supported"):
            await sdk.chat.completions.create(
                model="x", messages=ASK_TEXT, functions=[CALC["function"]]
            )
        with pytest.raises(openai.BadRequestError, match="context"):
            await sdk.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "one two " * 600}]
            )
        assert proxy.close_episode(episode) == []
        await sdk.close()

    _with_proxy(server, parrot, body, context_length=1024)


def test_malformed_requests_are_400s_naming_the_field_and_change_no_sample(
    server: Server, parrot: Path
) -> None:
    """Every malformed request of the table gets a 400 naming its field; the episode
    records none of them, and its next valid request samples with the seed it would have
    had without them (the same tokens as in a fresh episode)."""
    import aiohttp

    from tests.inference.bad_requests import BAD_CHAT, bad_body

    good = {"model": "x", "messages": ASK_TEXT, "max_tokens": 8, "temperature": 1.0}

    async def body(proxy: AgentProxy, _client: Any) -> None:
        episode, fresh = proxy.open_episode(seed=11), proxy.open_episode(seed=11)
        url = proxy.base_url(episode) + "/chat/completions"
        answers = []
        async with aiohttp.ClientSession() as http:
            for change, named in BAD_CHAT:
                data = json.dumps(bad_body(change))  # NaN as JSON's NaN, as Python sends it
                async with http.post(
                    url, data=data, headers={"Content-Type": "application/json"}
                ) as r:
                    answers.append((named, r.status, await r.text()))
            async with http.post(url, json=good) as r:
                assert r.status == 200
            async with http.post(proxy.base_url(fresh) + "/chat/completions", json=good) as r:
                assert r.status == 200
        wrong = [(n, s, t[:200]) for n, s, t in answers if s != 400 or n not in t]
        assert not wrong, wrong
        (record,) = proxy.close_episode(episode)
        (same,) = proxy.close_episode(fresh)
        assert (record.prompt_ids, record.output_ids, record.logprobs) == (
            same.prompt_ids, same.output_ids, same.logprobs,
        )  # fmt: skip

    _with_proxy(server, parrot, body, context_length=1024)


def test_a_proxy_beyond_loopback_needs_the_key(server: Server, parrot: Path) -> None:
    async def body(proxy: AgentProxy, _client: Any) -> None:
        episode = proxy.open_episode(seed=1)
        url = proxy.base_url(episode)
        async with openai.AsyncOpenAI(base_url=url, api_key="wrong") as wrong:
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()
        async with openai.AsyncOpenAI(base_url=url, api_key="s3cret") as right:
            assert (await right.models.list()).data[0].id == "parrot"

    _with_proxy(server, parrot, body, api_key="s3cret")


async def _arith_agent(data: dict, **kwargs: Any) -> float:
    """An agent of the kind a user writes: one chat turn, graded by the row's answer."""
    sdk = openai.AsyncOpenAI(
        base_url=kwargs["base_url"], api_key=kwargs["api_key"], http_client=kwargs["http_client"]
    )
    reply = await sdk.chat.completions.create(
        model="m", messages=[{"role": "user", "content": data["question"]}], max_tokens=8
    )
    return float((reply.choices[0].message.content or "").strip() == data["answer"])


def served_and_trained(server: Server, parrot: Path, agent: Any, route: str) -> float:
    """100 episodes of `agent` (one completion each) through the proxy: asserts that the
    batch the trainer reads holds exactly the ids the server returned; returns the
    largest |server logprob - a transformers forward of the served weights|."""
    from transformers import AutoModelForCausalLM

    from areal_cli.config.schema import GenerationHyperparameters

    async def body(proxy: AgentProxy, client: InferenceClient) -> tuple[list, Any]:
        seen = []
        original = proxy._generate

        async def recording(ids: list[int], params: dict) -> dict:
            answer = await original(ids, params)
            seen.append((list(ids), list(answer["output_ids"])))
            return answer

        proxy._generate = recording
        runner = AgentRunner(proxy, lambda: agent, "individual")
        episodes = []
        for i in range(100):
            ep = EpisodeClient(client, None, GenerationHyperparameters(), None, seed=i)
            row = {"question": f"What is {i % 10}+1?", "answer": str(i % 10 + 1)}
            episodes.append(runner.episode(ep, {"row": row}))
        outcomes = await asyncio.gather(*episodes)
        groups = [Group(o.trajectories, 0, i) for i, o in enumerate(outcomes)]
        return seen, _pack(groups, group_size=1)

    seen, batch = _with_proxy(server, parrot, body)
    assert batch.n_seqs == 100 and len(seen) == 100
    model = AutoModelForCausalLM.from_pretrained(parrot, dtype=torch.float32).eval()
    worst = 0.0
    served = {(tuple(p), tuple(o)) for p, o in seen}
    for i in range(batch.n_seqs):
        seq = batch.sequence(i)
        mask = seq["loss_mask"].bool()
        prompt = seq["input_ids"][~mask].tolist()
        assert (tuple(prompt), tuple(seq["input_ids"][mask].tolist())) in served
        with torch.no_grad():
            logits = model(seq["input_ids"][None]).logits[0, :-1].float()
        logp = logits.log_softmax(-1).gather(1, seq["input_ids"][1:, None])[:, 0]
        worst = max(worst, (logp[mask[1:]] - seq["logprobs"][mask]).abs().max().item())
    print(f"100 completions through {route}: max |server - recomputed| logprob {worst:.2e}")
    return worst


def test_trained_tokens_are_the_servers_and_logprobs_agree(server: Server, parrot: Path):
    """100 completions through chat agents: the batch the trainer reads holds exactly the
    ids the server returned, and a forward of the served weights gives their logprobs."""
    assert served_and_trained(server, parrot, _arith_agent, "/v1/chat/completions") < 1e-4


def test_episodes_share_one_tls_context(
    server: Server, parrot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each episode's HTTP client reuses the runner's TLS context: building one loads the
    CA bundle, ~40 ms of the controller's loop per episode (a tool-agent run of 4 steps took
    19 CPU-s in the controller with one per episode, 7 with one in all)."""
    import ssl

    from areal_cli.config.schema import GenerationHyperparameters

    loads = []
    real = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        loads.append(args or kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)

    async def body(proxy: AgentProxy, client: InferenceClient) -> list:
        runner = AgentRunner(proxy, lambda: _arith_agent, "individual")
        episodes = [
            runner.episode(
                EpisodeClient(client, None, GenerationHyperparameters(), None, seed=i),
                {"row": {"question": "What is 1+1?", "answer": "2"}},
            )
            for i in range(8)
        ]
        return await asyncio.gather(*episodes)

    outcomes = _with_proxy(server, parrot, body)
    assert all(o.counters["agent_completions"] == 1 for o in outcomes)
    assert len(loads) <= 1, f"{len(loads)} CA bundle loads for 8 episodes"


def test_the_embedded_servers_own_chat_route_parses_tool_calls(server: Server) -> None:
    """`areal serve`'s chat route renders tools and answers tool_calls like the proxy."""
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    called = sdk.chat.completions.create(
        model="parrot", messages=ASK_TOOL, tools=[CALC], temperature=0
    )
    assert called.choices[0].finish_reason == "tool_calls"
    assert called.choices[0].message.tool_calls[0].function.name == "add"
    broken = sdk.chat.completions.create(
        model="parrot", messages=ASK_BROKEN, tools=[CALC], temperature=0
    )
    assert broken.choices[0].message.content == BROKEN_REPLY
    assert broken.choices[0].finish_reason == "stop"
    no_tools = sdk.chat.completions.create(
        model="parrot", messages=ASK_TOOL, tools=[CALC], tool_choice="none", temperature=0
    )
    assert no_tools.choices[0].message.tool_calls is None
