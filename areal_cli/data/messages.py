"""The Anthropic Messages API (`POST /v1/messages`) as the agent proxy speaks it.

A Messages request becomes the OpenAI conversation the chat template renders
(areal_cli.data.chat), and the reply the model wrote becomes a Messages answer:
  request   system (text or text blocks); messages whose content is text or blocks:
            text, tool_use (assistant), tool_result (user); tools {name, description,
            input_schema}; tool_choice {type: auto | any | tool | none}; max_tokens,
            stop_sequences; stream. temperature, top_p and top_k are read when a request
            carries them (the SDK's create() no longer has them: then gconfig's apply).
  answer    {id, type: message, role: assistant, model, content: [text and tool_use
            blocks], stop_reason: end_turn | max_tokens | stop_sequence | tool_use,
            stop_sequence, usage {input_tokens, output_tokens}}, or with stream the
            events message_start, content_block_start/delta/stop (text_delta,
            input_json_delta), message_delta, message_stop.
Field names and shapes follow the `anthropic` package's types (tests check answers with
`anthropic.types.Message` and streams with the SDK's own stream helper). Blocks the
proxy cannot feed a text model (image, document, thinking) get a 400 that names them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from areal_cli.data.chat import ChatRequestError, ParsedReply

# Messages fields that change nothing here
IGNORED = frozenset(
    {
        "model", "metadata", "service_tier", "stream", "container", "mcp_servers",
        "cache_control", "diagnostics", "inference_geo", "user_profile_id", "workspace_id",
    }
)  # fmt: skip
OWN = frozenset(
    {
        "messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences",
        "temperature", "top_p", "top_k", "thinking", "output_config",
    }
)  # fmt: skip
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _text_of(content: Any, where: str) -> str:
    """Text content: a string, or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if not isinstance(block, Mapping) or block.get("type") != "text":
                kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
                raise ChatRequestError(
                    f"{where}: a {kind!r} block is not supported here; send text"
                )
            parts.append(str(block.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise ChatRequestError(f"{where} must be a string or a list of text blocks")


def to_chat(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict] | None, Any]:
    """The OpenAI messages, tools and tool_choice of a Messages request."""
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") not in (None, "disabled"):
        raise ChatRequestError("thinking is not supported by areal's agent proxy; leave it out")
    config = body.get("output_config")
    if isinstance(config, Mapping) and config.get("format"):
        raise ChatRequestError(
            "output_config.format is not supported: the proxy does not constrain decoding; "
            "ask for the format in the prompt"
        )
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text_of(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list")
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            raise ChatRequestError(f"messages[{n}] needs role user or assistant")
        out += _message(message, f"messages[{n}]")
    return out, _tools(body.get("tools")), _tool_choice(body.get("tool_choice"))


def _message(message: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ChatRequestError(f"{where}.content must be a string or a list of blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {
                        "name": str(block.get("name", "")),
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            text = _text_of(block.get("content"), f"{where}.content[{i}].content")
            results.append(
                {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text}
            )
        else:
            raise ChatRequestError(
                f"{where}.content[{i}]: a {kind!r} block in a {role} message is not supported; "
                "areal's agent proxy takes text, tool_use (assistant) and tool_result (user)"
            )
    if role == "assistant":
        message_out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message_out["tool_calls"] = calls
        return [message_out]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list")
    out = []
    for n, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise ChatRequestError(f"tools[{n}] needs a name (a client tool: name, input_schema)")
        if tool.get("type") not in (None, "custom"):
            raise ChatRequestError(
                f"tools[{n}] is a server tool ({tool['type']}); areal's agent proxy runs none"
            )
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ChatRequestError("tool_choice must be {type: auto | any | none} or {type: tool, name}")


def message_answer(
    reply: ParsedReply,
    finish: str,
    stop_sequence: str | None,
    usage: tuple[int, int],
    model: str,
    message_id: str,
) -> dict[str, Any]:
    """The Messages answer of a reply: its text, then one tool_use block per call."""
    content: list[dict[str, Any]] = []
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            arguments = {"arguments": call.arguments}
        content.append(
            {
                "type": "tool_use",
                "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}",
                "name": call.name,
                "input": arguments if isinstance(arguments, dict) else {"value": arguments},
            }
        )
    reason = "stop_sequence" if stop_sequence else STOP_REASONS.get(finish, "end_turn")
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
    }


def message_events(answer: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A finished answer as the (event, data) pairs of a streamed one, in the Messages
    API's order; the whole reply is generated first, then sent this way."""
    head = {**answer, "content": [], "stop_reason": None, "stop_sequence": None}
    head["usage"] = {"input_tokens": answer["usage"]["input_tokens"], "output_tokens": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": head})
    ]
    for i, block in enumerate(answer["content"]):
        if block["type"] == "text":
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [
            ("content_block_start", {"type": "content_block_start", "index": i, "content_block": start}),
            ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": i}),
        ]  # fmt: skip
    stop = {"stop_reason": answer["stop_reason"], "stop_sequence": answer["stop_sequence"]}
    usage = {"output_tokens": answer["usage"]["output_tokens"]}
    events.append(("message_delta", {"type": "message_delta", "delta": stop, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events
