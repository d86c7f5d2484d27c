"""The agent proxy's Anthropic Messages route (`POST /v1/messages`) in front of a real
embedded server, driven by the real `anthropic` SDK (the `agents` extra): its answers
parse as `anthropic.types.Message`, its streams through the SDK's own stream helper, and
the tokens trained from it are the server's, exactly. The server runs test_agent_proxy's
"parrot", so a tools request meets a reply that a model really generated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from areal_cli.data.messages import message_events, to_chat
from areal_cli.rollout.proxy import AgentProxy
from tests.inference.parrot import ASK_BROKEN, ASK_TEXT, ASK_TOOL, BROKEN_REPLY, TEXT_REPLY
from tests.inference.test_agent_proxy import _with_proxy, served_and_trained
from tests.inference.test_server import Server

anthropic = pytest.importorskip("anthropic", reason="the agents extra (pip install -e '.[agents]')")
pytestmark = pytest.mark.slow


# The SDK's create() has no sampling fields (Anthropic's newer models fix them); a request
# may still carry them, and the proxy reads them: greedy, for the parrot's fixed replies.
GREEDY = {"temperature": 0}
ADD = {
    "name": "add",
    "description": "Add two numbers",
    "input_schema": {"type": "object", "properties": {"a": {}, "b": {}}},
}


def _sdk(proxy: AgentProxy, episode: Any) -> Any:
    """The Anthropic SDK at the episode's address (it appends /v1/messages itself)."""
    return anthropic.AsyncAnthropic(
        base_url=proxy.base_url(episode).removesuffix("/v1"), api_key="unused"
    )


def test_a_messages_request_is_the_chat_conversation_the_template_renders() -> None:
    """Without a server: system, text, tool_use and tool_result blocks, tools and
    tool_choice as the OpenAI conversation the chat template takes."""
    body = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "What is 12+34?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me add."},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 12, "b": 34}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "46"},
                    {"type": "text", "text": "Go on."},
                ],
            },
        ],
        "tools": [ADD],
        "tool_choice": {"type": "tool", "name": "add"},
    }  # fmt: skip
    messages, tools, choice = to_chat(body)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12+34?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 12, "b": 34}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "46"},
        {"role": "user", "content": "Go on."},
    ]
    assert tools == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": ADD["input_schema"],
                "description": "Add two numbers",
            },
        }
    ]
    assert choice == {"type": "function", "function": {"name": "add"}}


def test_a_stream_is_the_sdks_event_types() -> None:
    """Every event of a streamed answer parses as the SDK's own event type."""
    from pydantic import TypeAdapter

    answer = {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "parrot",
        "content": [
            {"type": "text", "text": "I will add."},
            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}},
        ],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 9},
    }  # fmt: skip
    anthropic.types.Message.model_validate(answer)
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    kinds = []
    for name, data in message_events(answer):
        event = adapter.validate_python(data)
        assert event.type == name
        kinds.append(name)
    assert kinds == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_stop"] * 2,
        "message_delta",
        "message_stop",
    ]


def test_the_anthropic_sdk_gets_tool_use_text_stops_and_streams(
    server: Server, parrot: Path
) -> None:
    async def body(proxy: AgentProxy, _client: Any) -> None:
        episode = proxy.open_episode(seed=7)
        sdk = _sdk(proxy, episode)
        called = await sdk.messages.create(
            model="anything", max_tokens=160, messages=ASK_TOOL, tools=[ADD], extra_body=GREEDY
        )
        assert called.stop_reason == "tool_use" and called.role == "assistant"
        (use,) = [b for b in called.content if b.type == "tool_use"]
        assert use.name == "add" and use.input == {"a": 12, "b": 34}
        assert called.usage.output_tokens > 0 and called.usage.input_tokens > 0
        # the tool's result goes back as a tool_result block; the conversation extends
        history = ASK_TOOL + [
            {"role": "assistant", "content": [b.model_dump() for b in called.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "46"}],
            },
        ]
        await sdk.messages.create(
            model="x", max_tokens=4, messages=history, tools=[ADD], extra_body=GREEDY
        )
        broken = await sdk.messages.create(
            model="x", max_tokens=160, messages=ASK_BROKEN, tools=[ADD], extra_body=GREEDY
        )
        assert broken.stop_reason == "end_turn"
        assert [b.type for b in broken.content] == ["text"]
        assert broken.content[0].text == BROKEN_REPLY
        plain = await sdk.messages.create(
            model="x", max_tokens=160, messages=ASK_TEXT, system="You are a parrot.",
            extra_body=GREEDY,
        )  # fmt: skip
        assert plain.stop_reason == "end_turn"
        short = await sdk.messages.create(
            model="x", max_tokens=2, messages=ASK_TEXT, tools=[ADD], extra_body=GREEDY
        )
        assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
        cut = await sdk.messages.create(
            model="x", max_tokens=160, messages=ASK_TEXT, tools=[ADD], extra_body=GREEDY,
            stop_sequences=["there"],
        )  # fmt: skip
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "there"
        assert cut.content[0].text == TEXT_REPLY[: TEXT_REPLY.index("there")]
        # the SDK's own stream helper: text deltas, and a tool_use block
        async with sdk.messages.stream(
            model="x", max_tokens=160, messages=ASK_TEXT, tools=[ADD], extra_body=GREEDY
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
        assert text == TEXT_REPLY
        async with sdk.messages.stream(
            model="x", max_tokens=160, messages=ASK_TOOL, tools=[ADD], extra_body=GREEDY
        ) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use"
        assert [b.input for b in final.content if b.type == "tool_use"] == [{"a": 12, "b": 34}]
        records = proxy.close_episode(episode)
        assert len(records) == 8 and records[0].id == called.id
        first = records[0]  # the second request's prompt extends the first's prompt and reply
        assert records[1].prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == (
            first.prompt_ids + first.output_ids
        )
        with pytest.raises(anthropic.NotFoundError):  # the episode is over
            await sdk.messages.create(model="x", max_tokens=4, messages=ASK_TEXT)
        await sdk.close()

    _with_proxy(server, parrot, body)


def test_bad_messages_requests_are_named(server: Server, parrot: Path) -> None:
    async def body(proxy: AgentProxy, _client: Any) -> list[str]:
        episode = proxy.open_episode(seed=1)
        sdk = _sdk(proxy, episode)
        said = []
        for extra in (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        ):
            request = {"model": "x", "max_tokens": 8, "messages": ASK_TEXT, **extra}
            with pytest.raises(anthropic.BadRequestError) as err:
                await sdk.messages.create(**request)
            said.append(str(err.value))
        assert not proxy.close_episode(episode)  # nothing was sampled
        await sdk.close()
        return said

    said = _with_proxy(server, parrot, body)
    assert "'image' block in a user message is not supported" in said[0]
    assert "thinking is not supported" in said[1]
    assert "is a server tool (web_search_20250305)" in said[2]


async def _anthropic_agent(data: dict, **kwargs: Any) -> float:
    """An agent of the kind a user writes with the Anthropic SDK: one turn, graded."""
    sdk = anthropic.AsyncAnthropic(
        base_url=kwargs["base_url"].removesuffix("/v1"),
        api_key=kwargs["api_key"],
        http_client=kwargs["http_client"],
    )
    reply = await sdk.messages.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": data["question"]}]
    )
    text = "".join(b.text for b in reply.content if b.type == "text")
    return float(text.strip() == data["answer"])


def test_trained_tokens_through_messages_are_the_servers_and_logprobs_agree(
    server: Server, parrot: Path
) -> None:
    """100 completions through /v1/messages by Anthropic-SDK agents: the batch the
    trainer reads holds exactly the ids the server returned, and a forward of the served
    weights gives their logprobs (within 1e-4)."""
    assert served_and_trained(server, parrot, _anthropic_agent, "/v1/messages") < 1e-4
