"""What an OpenAI request may hold: the type and range of every field the embedded
server's OpenAI routes and the agent proxy (areal_cli.rollout.proxy) honour, checked
alike by both before anything is rendered or generated.

`check_request(body, route)` raises ChatRequestError (answered as a 400) naming the first
field that is wrong and what it must be, as OpenAI's and vLLM's servers do: a request the
server cannot serve is a client error, never a 500 and never a quiet 200. Which fields a
route accepts at all is each front's own rule (the server refuses what it does not
implement, the proxy ignores what changes nothing); this module only checks the values.
`check_room(limit, n_prompt, context)` is the one check that needs the rendered prompt:
max_tokens must fit in the context beside it. `json_object(request, error)` reads the body
every front starts from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from areal_cli.data.chat import ChatRequestError

Route = Literal["chat", "completions"]
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")


async def json_object(
    request: Any, error: Callable[[str], Exception], empty: bool = True
) -> dict[str, Any]:
    """The JSON object an aiohttp `request` carries ({} when it has no body and `empty`
    allows that); otherwise raises `error(message)`, which each front answers as its 400."""
    if empty and not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise error("the body is not JSON") from None
    if not isinstance(body, dict):
        raise error("the body must be a JSON object")
    return body


def check_request(body: Mapping[str, Any], route: Route) -> None:
    """Every honoured field of an OpenAI `route` request (see the module docstring)."""
    _number(body, "temperature", low=0.0, high=None)
    _number(body, "top_p", low=0.0, high=1.0, low_open=True)
    _number(body, "frequency_penalty", low=-2.0, high=2.0)
    _number(body, "presence_penalty", low=-2.0, high=2.0)
    _integer(body, "top_k", low=-1)
    _integer(body, "max_tokens", low=1)
    _integer(body, "max_completion_tokens", low=1)
    _integer(body, "n", low=1)
    _integer(body, "seed", low=None)
    _boolean(body, "stream")
    _boolean(body, "ignore_eos")
    _string_or_strings(body, "stop")
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(t) for t in ids)):
        raise ChatRequestError("'stop_token_ids' must be a list of integers")
    if route == "chat":
        _boolean(body, "logprobs")
        _integer(body, "top_logprobs", low=0, high=20)
        names = _check_tools(body.get("tools"))
        _check_tool_choice(body.get("tool_choice"), names)
        _check_messages(body.get("messages"))
    else:
        _integer(body, "logprobs", low=0, high=5)


def check_room(limit: Any, n_prompt: int, context: int) -> None:
    """max_tokens (None: as many as fit) beside a prompt of `n_prompt` tokens must fit in
    the model's `context`."""
    if n_prompt >= context:
        raise ChatRequestError(
            f"the prompt has {n_prompt} tokens; the model's context is {context}: "
            "shorten the conversation"
        )
    if limit is not None and n_prompt + int(limit) > context:
        raise ChatRequestError(
            f"'max_tokens' is {limit}, but the prompt has {n_prompt} tokens and the model's "
            f"context is {context}: ask for at most {context - n_prompt}"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(
    body: Mapping[str, Any],
    key: str,
    low: float | None,
    high: float | None,
    low_open: bool = False,
) -> None:
    value = body.get(key)
    if value is None:
        return
    above = f"> {low:g}" if low_open else f">= {low:g}"
    bounds = (
        f"in ({low:g}, {high:g}]"
        if low_open and high is not None
        else f"in [{low:g}, {high:g}]"
        if high is not None
        else above
    )
    if not _is_number(value) or not math.isfinite(value):
        raise ChatRequestError(f"'{key}' must be a finite number {bounds} (got {value!r})")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        raise ChatRequestError(f"'{key}' must be {bounds} (got {value!r})")


def _integer(body: Mapping[str, Any], key: str, low: int | None, high: int | None = None) -> None:
    value = body.get(key)
    if value is None:
        return
    if not _is_int(value):
        raise ChatRequestError(f"'{key}' must be an integer (got {value!r})")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ChatRequestError(f"'{key}' must be {bounds} (got {value!r})")


def _boolean(body: Mapping[str, Any], key: str) -> None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise ChatRequestError(f"'{key}' must be true or false (got {value!r})")


def _string_or_strings(body: Mapping[str, Any], key: str) -> None:
    value = body.get(key)
    if value is None or isinstance(value, str):
        return
    if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise ChatRequestError(f"'{key}' must be a string or a list of strings")


def _check_tools(tools: Any) -> set[str]:
    """The offered tools' names; each must be a function tool with a name."""
    if tools is None:
        return set()
    if not isinstance(tools, list):
        raise ChatRequestError("'tools' must be a list of tool objects")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ChatRequestError(f"'{where}' must be an object")
        if tool.get("type") != "function":
            raise ChatRequestError(f"'{where}.type' must be 'function' (got {tool.get('type')!r})")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatRequestError(f"'{where}.function.name' must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ChatRequestError(f"'{where}.function.parameters' must be a JSON Schema object")
        names.add(fn["name"])
    return names


def _check_tool_choice(choice: Any, names: set[str]) -> None:
    if choice is None or choice in TOOL_CHOICES:
        if choice == "required" and not names:
            raise ChatRequestError("'tool_choice' is 'required' but no 'tools' are given")
        return
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    if not (
        isinstance(choice, Mapping)
        and choice.get("type") == "function"
        and isinstance(fn, Mapping)
        and isinstance(fn.get("name"), str)
    ):
        raise ChatRequestError(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )
    if fn["name"] not in names:
        raise ChatRequestError(f"'tool_choice' names {fn['name']!r}, which is not in 'tools'")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("'messages' must be a non-empty list of messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatRequestError(f"'{where}' must be an object with a role")
        role = message.get("role")
        if role not in ROLES:
            raise ChatRequestError(
                f"'{where}.role' must be one of {', '.join(ROLES)} (got {role!r})"
            )
        content = message.get("content")
        if content is not None and not _is_content(content):
            raise ChatRequestError(f"'{where}.content' must be a string or a list of text parts")
        calls = message.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            raise ChatRequestError(
                f"'{where}.tool_calls' must be a list, on an assistant message only"
            )
        if content is None and not (role == "assistant" and calls):
            raise ChatRequestError(
                f"'{where}.content' is required for an assistant message without tool_calls"
                if role == "assistant"
                else f"'{where}.content' is required for a {role} message"
            )


def _is_content(content: Any) -> bool:
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    )
