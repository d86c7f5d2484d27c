"""The agent proxy's OpenAI Responses route (`POST /v1/responses`) in front of a real
embedded server, driven by the real `openai` SDK: answers parse as
`openai.types.responses.Response`, streams through the SDK's own stream helper, a
conversation goes on by previous_response_id, and the tokens trained from it are the
server's, exactly. The server runs test_agent_proxy's "parrot"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import TypeAdapter

from areal_cli.data.chat import ParsedReply, ToolCall
from areal_cli.data.responses import input_messages, output_items, response_answer, response_events
from areal_cli.rollout.proxy import AgentProxy
from tests.inference.parrot import BROKEN_REPLY, TEXT_REPLY
from tests.inference.test_agent_proxy import _with_proxy, served_and_trained
from tests.inference.test_server import Server

pytestmark = pytest.mark.slow

ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {}, "b": {}}},
}


def test_input_items_are_the_chat_conversation() -> None:
    body = {
        "input": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "What is 12+34?"}]},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 12}'},
            {"type": "function_call_output", "call_id": "c1", "output": "46"},
        ]
    }
    assert input_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12+34?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 12}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "46"},
    ]  # fmt: skip


def test_answers_and_streams_are_the_sdks_types() -> None:
    reply = ParsedReply("Let me add.", (ToolCall("add", '{"a": 1}', "call_1"),))
    answer = response_answer({"tools": [ADD]}, "resp_1", output_items(reply), "tool_calls", (5, 9), "parrot")  # fmt: skip
    parsed = openai.types.responses.Response.model_validate(answer)
    assert parsed.output_text == "Let me add." and parsed.output[1].call_id == "call_1"
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    kinds = [adapter.validate_python(data).type for _, data in response_events(answer)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert "response.function_call_arguments.done" in kinds


def test_the_openai_sdk_gets_function_calls_text_and_streams(server: Server, parrot: Path) -> None:
    async def body(proxy: AgentProxy, _client: Any) -> None:
        episode = proxy.open_episode(seed=7)
        sdk = openai.AsyncOpenAI(base_url=proxy.base_url(episode), api_key="unused")
        called = await sdk.responses.create(
            model="x", input="What is 12+34?", tools=[ADD], temperature=0
        )
        (call,) = [item for item in called.output if item.type == "function_call"]
        assert call.name == "add" and json.loads(call.arguments) == {"a": 12, "b": 34}
        assert called.status == "completed" and called.usage.output_tokens > 0
        # the tool's output goes back by previous_response_id: the conversation extends
        follow = await sdk.responses.create(
            model="x", previous_response_id=called.id, tools=[ADD], temperature=0,
            max_output_tokens=4,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "46"}],
        )  # fmt: skip
        assert follow.status == "incomplete"
        assert follow.incomplete_details.reason == "max_output_tokens"
        broken = await sdk.responses.create(
            model="x", input="What is 5+6?", tools=[ADD], temperature=0
        )
        assert broken.output_text == BROKEN_REPLY
        assert [item.type for item in broken.output] == ["message"]
        plain = await sdk.responses.create(
            model="x", input=[{"role": "user", "content": "hello"}], instructions="Parrot.",
            temperature=0,
        )  # fmt: skip
        assert plain.output_text  # the parrot's reply to another prompt: some text
        async with sdk.responses.stream(
            model="x", input="hello", tools=[ADD], temperature=0
        ) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert "".join(deltas) == TEXT_REPLY == final.output_text
        async with sdk.responses.stream(
            model="x", input="What is 12+34?", tools=[ADD], temperature=0
        ) as stream:
            final = await stream.get_final_response()
        assert [json.loads(i.arguments) for i in final.output if i.type == "function_call"] == [
            {"a": 12, "b": 34}
        ]
        records = proxy.close_episode(episode)
        assert len(records) == 6 and records[0].id == called.id
        first = records[0]  # the follow-up's prompt extends the first's prompt and reply
        assert records[1].prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == (
            first.prompt_ids + first.output_ids
        )
        with pytest.raises(openai.NotFoundError):  # the episode is over
            await sdk.responses.create(model="x", input="hello")
        await sdk.close()

    _with_proxy(server, parrot, body)


def test_bad_responses_requests_are_named(server: Server, parrot: Path) -> None:
    async def body(proxy: AgentProxy, _client: Any) -> list[str]:
        episode = proxy.open_episode(seed=1)
        sdk = openai.AsyncOpenAI(base_url=proxy.base_url(episode), api_key="unused")
        said = []
        for extra in (
            {"tools": [{"type": "web_search"}]},
            {"previous_response_id": "resp_nope"},
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            {"text": {"format": {"type": "json_object"}}},
        ):
            request = {"model": "x", "input": "hello", **extra}
            with pytest.raises(openai.BadRequestError) as err:
                await sdk.responses.create(**request)
            said.append(str(err.value))
        assert not proxy.close_episode(episode)  # nothing was sampled
        await sdk.close()
        return said

    said = _with_proxy(server, parrot, body)
    assert "tools[0] is a 'web_search' tool" in said[0]
    assert "previous_response_id 'resp_nope' is no response of this episode" in said[1]
    assert "'input_image' part is not supported" in said[2]
    assert "text.format 'json_object' is not supported" in said[3]


async def _responses_agent(data: dict, **kwargs: Any) -> float:
    """An agent of the kind a user writes with the Responses API: one turn, graded."""
    sdk = openai.AsyncOpenAI(
        base_url=kwargs["base_url"], api_key=kwargs["api_key"], http_client=kwargs["http_client"]
    )
    reply = await sdk.responses.create(model="m", input=data["question"], max_output_tokens=8)
    return float(reply.output_text.strip() == data["answer"])


def test_trained_tokens_through_responses_are_the_servers_and_logprobs_agree(
    server: Server, parrot: Path
) -> None:
    """100 completions through /v1/responses: the batch the trainer reads holds exactly
    the ids the server returned, and a forward of the served weights gives their
    logprobs (within 1e-4)."""
    assert served_and_trained(server, parrot, _responses_agent, "/v1/responses") < 1e-4


def test_an_openai_agents_sdk_agent_calls_its_tool_and_streams(server: Server, parrot: Path):
    """The OpenAI Agents SDK (openai-agents) unchanged: its Runner's Responses model calls
    a function tool through the proxy, runs it and stops on its output; a streamed run's
    text deltas arrive as the SDK's raw response events; the proxy recorded each turn."""
    agents = pytest.importorskip("agents", reason="the agents extra (pip install -e '.[agents]')")
    from openai.types.responses import ResponseTextDeltaEvent

    ran: list[dict] = []

    async def add(_ctx: Any, arguments: str) -> str:
        ran.append(json.loads(arguments))
        return str(sum(ran[-1].values()))

    tool = agents.FunctionTool(
        name="add", description=ADD["description"], params_json_schema=ADD["parameters"],
        on_invoke_tool=add, strict_json_schema=False,
    )  # fmt: skip

    async def body(proxy: AgentProxy, _client: Any) -> None:
        episode = proxy.open_episode(seed=3)
        sdk = openai.AsyncOpenAI(base_url=proxy.base_url(episode), api_key="unused")
        model = agents.OpenAIResponsesModel(model="x", openai_client=sdk)
        settings = agents.ModelSettings(temperature=0)
        config = agents.RunConfig(tracing_disabled=True)
        calc = agents.Agent(
            name="calc", model=model, tools=[tool], model_settings=settings,
            tool_use_behavior="stop_on_first_tool",
        )  # fmt: skip
        result = await agents.Runner.run(calc, "What is 12+34?", run_config=config)
        assert ran == [{"a": 12, "b": 34}] and result.final_output == "46"
        talk = agents.Agent(name="talk", model=model, tools=[tool], model_settings=settings)
        streamed = agents.Runner.run_streamed(talk, "hello", run_config=config)
        deltas = [
            event.data.delta
            async for event in streamed.stream_events()
            if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent)
        ]
        assert "".join(deltas) == TEXT_REPLY == streamed.final_output
        records = proxy.close_episode(episode)
        assert [r.finish_reason for r in records] == ["tool_calls", "stop"]
        await sdk.close()

    _with_proxy(server, parrot, body)
