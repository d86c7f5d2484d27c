"""Malformed OpenAI chat requests, each with the field its 400 must name: the seven an
agent sent during a real run (issue 49), then the rest of what data.requests checks. The
agent proxy (test_agent_proxy.py, and a real run in tests/e2e/test_agent.py) and the
embedded server (test_server.py) must answer every one with a 4xx naming the field, never
a 500 and never a 200."""

from __future__ import annotations

from typing import Any

ASK = [{"role": "user", "content": "What is 1+2?"}]
ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
}

# (what replaces or joins a valid request {"model", "messages": ASK, "max_tokens": 4}, named)
BAD_CHAT: list[tuple[dict[str, Any], str]] = [
    ({"temperature": float("nan")}, "'temperature'"),
    ({"tools": [{"type": "nope"}]}, "'tools[0].type'"),
    ({"max_tokens": -3}, "'max_tokens'"),
    ({"top_p": 7}, "'top_p'"),
    ({"max_tokens": 1_000_000_000}, "'max_tokens'"),
    ({"messages": [{"role": "bogus", "content": "hi"}]}, "'messages[0].role'"),
    ({"messages": [{"role": "user"}]}, "'messages[0].content'"),
    # the rest of the checks
    ({"temperature": "hot"}, "'temperature'"),
    ({"temperature": -1}, "'temperature'"),
    ({"temperature": float("inf")}, "'temperature'"),
    ({"top_p": 0}, "'top_p'"),
    ({"top_k": 2.5}, "'top_k'"),
    ({"max_tokens": "4"}, "'max_tokens'"),
    ({"max_tokens": True}, "'max_tokens'"),
    ({"max_completion_tokens": 0}, "'max_completion_tokens'"),
    ({"seed": "x"}, "'seed'"),
    ({"frequency_penalty": 9}, "'frequency_penalty'"),
    ({"stop": 5}, "'stop'"),
    ({"stream": "yes"}, "'stream'"),
    ({"logprobs": "yes"}, "'logprobs'"),
    ({"tools": "add"}, "'tools'"),
    ({"tools": [{"type": "function", "function": {}}]}, "'tools[0].function.name'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "'tools[0].function.parameters'"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "'tool_choice'"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "'tool_choice'"),
    ({"tool_choice": "required"}, "'tool_choice'"),
    ({"messages": []}, "'messages'"),
    ({"messages": "hi"}, "'messages'"),
    ({"messages": ["hi"]}, "'messages[0]'"),
    ({"messages": [{"role": "user", "content": 5}]}, "'messages[0].content'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "'messages[0].content'"),
    ({"messages": [*ASK, {"role": "assistant"}]}, "'messages[1].content'"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     "'messages[0].tool_calls'"),
    ({"n": 0}, "'n'"),
]  # fmt: skip


def bad_body(change: dict[str, Any]) -> dict[str, Any]:
    return {"model": "any", "messages": ASK, "max_tokens": 4, **change}
