"""The OpenAI Responses API (`POST /v1/responses`) as the agent proxy speaks it.

A Responses request becomes the OpenAI chat conversation the chat template renders
(areal_cli.data.chat), and the reply the model wrote becomes a Response:
  request   instructions (a system message for this response only); input: text, or
            items: messages (role user, assistant, system or developer; text or
            input_text/output_text parts), function_call and function_call_output;
            previous_response_id (the episode's earlier response: its conversation and
            output come first); tools of type function; tool_choice; max_output_tokens,
            temperature, top_p; stream.
  answer    {id: resp_..., object: response, status: completed | incomplete, output:
            [a message item with output_text, then function_call items], usage, ...}, or
            with stream the events response.created, response.in_progress,
            response.output_item.added, response.content_part.added,
            response.output_text.delta/.done, response.content_part.done,
            response.function_call_arguments.delta/.done, response.output_item.done,
            response.completed, numbered by sequence_number.
Names and shapes follow the `openai` package's types (tests check answers with
`openai.types.responses.Response` and streams with the SDK's own stream helper). What the
proxy cannot do for a text model (images, files, built-in tools, structured output,
background responses) gets a 400 that names it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from areal_cli.data.chat import ChatRequestError, ParsedReply

IGNORED = frozenset(
    {
        "model", "metadata", "store", "user", "parallel_tool_calls", "truncation",
        "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
        "stream", "stream_options", "include", "top_logprobs", "reasoning", "max_tool_calls",
    }
)  # fmt: skip
OWN = frozenset(
    {
        "input", "instructions", "previous_response_id", "tools", "tool_choice",
        "max_output_tokens", "temperature", "top_p", "text", "background",
    }
)  # fmt: skip


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in ("input_text", "output_text", "text"):
                raise ChatRequestError(f"{where}: a {kind!r} part is not supported; send text")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ChatRequestError(f"{where} must be text or a list of text parts")


def input_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """This request's own turns (`input`) as OpenAI chat messages."""
    if body.get("background"):
        raise ChatRequestError("background responses are not supported; leave background out")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        raise ChatRequestError(
            f"text.format {fmt.get('type')!r} is not supported: the proxy does not constrain "
            "decoding; ask for the format in the prompt"
        )
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ChatRequestError("input must be text or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for n, item in enumerate(items):
        where = f"input[{n}]"
        kind = item.get("type", "message") if isinstance(item, Mapping) else None
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "assistant", "system"):
                raise ChatRequestError(f"{where} needs role user, assistant, system or developer")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id", "")),
                "type": "function",
                "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments") or "{}")},
            }  # fmt: skip
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text}
            )
        elif kind == "reasoning":
            continue  # a reasoning item of an earlier response: nothing to render
        else:
            raise ChatRequestError(f"{where}: an item of type {kind!r} is not supported")
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list")
    out = []
    for n, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise ChatRequestError(
                f"tools[{n}] is a {kind!r} tool; areal's agent proxy runs none: give function tools"
            )
        function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ChatRequestError("tool_choice must be auto, none, required or {type: function, name}")


def output_items(reply: ParsedReply) -> list[dict[str, Any]]:
    """A reply's output items: its text as one message, then one function_call per call."""
    items: list[dict[str, Any]] = []
    if reply.content:
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": reply.content, "annotations": []}],
            }
        )
    for call in reply.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
        )
    return items


def as_chat_message(reply: ParsedReply) -> dict[str, Any]:
    """The reply as the assistant turn a later response's conversation holds."""
    message = reply.message()
    message["content"] = message.get("content") or ""
    return message


def response_answer(
    body: Mapping[str, Any], response_id: str, items: list[dict], finish: str, usage: tuple[int, int], model: str
) -> dict[str, Any]:  # fmt: skip
    n_in, n_out = usage
    incomplete = finish == "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": time.time(),
        "model": model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "output": items,
        "parallel_tool_calls": True,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "text": {"format": {"type": "text"}},
        "usage": {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_in + n_out,
        },
    }


def response_events(answer: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A finished Response as the events of a streamed one, numbered in order."""
    events: list[tuple[str, dict[str, Any]]] = []

    def add(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **fields}))

    start = {**answer, "status": "in_progress", "output": [], "incomplete_details": None}
    add("response.created", response=start)
    add("response.in_progress", response=start)
    for i, item in enumerate(answer["output"]):
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            add(
                "response.output_item.added",
                output_index=i,
                item={**item, "status": "in_progress", "content": []},
            )
            empty = {"type": "output_text", "text": "", "annotations": []}
            add("response.content_part.added", **at, content_index=0, part=empty)
            add("response.output_text.delta", **at, content_index=0, delta=text, logprobs=[])
            add("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
            add("response.content_part.done", **at, content_index=0, part=item["content"][0])
        else:
            add(
                "response.output_item.added",
                output_index=i,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            add("response.function_call_arguments.delta", **at, delta=item["arguments"])
            add(
                "response.function_call_arguments.done",
                **at,
                name=item["name"],
                arguments=item["arguments"],
            )
        add("response.output_item.done", output_index=i, item=item)
    done = "response.incomplete" if answer["status"] == "incomplete" else "response.completed"
    add(done, response=answer)
    return events
