"""OpenAI chat requests as token ids, and tool calls parsed back out of generated text.

Shared by the embedded server's `/v1/chat/completions` and the agent proxy
(areal_cli.rollout.proxy), so both render a conversation and read tool calls alike.

Rendering: `chat_prompt_ids(tokenizer, messages, tools)` applies the tokenizer's chat
template once, with the request's `tools` (OpenAI's function schemas) and the assistant
turns' `tool_calls` handed to the template as Hugging Face templates expect them
(`arguments` as a dict, not a JSON string).

Tool-call formats (`tool_parser`, chosen from the chat template when "auto"):
  hermes  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call,
          text outside the blocks is the message's content (Qwen 2.5/3, Hermes);
  llama3  the whole reply is one JSON object `{"name": ..., "parameters": {...}}`, or
          several joined by `;`, optionally after `<|python_tag|>` (Llama 3.1/3.2);
  none    no parsing: the reply is content.
A reply that looks like a tool call but is not a valid one (bad JSON, no name, a block
left open) comes back as plain content with finish_reason "stop": the agent sees what the
model wrote, and the episode goes on.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TOOL_PARSERS = ("auto", "hermes", "llama3", "none")


class ChatRequestError(ValueError):
    """A chat request that cannot be rendered (the message says which field)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()

    def message(self) -> dict[str, Any]:
        """The OpenAI `choices[0].message` of this reply."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return out


def detect_tool_parser(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model ("none" when it has none)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return "llama3"
    return "none"


def resolve_tool_parser(setting: str, tokenizer: Any) -> str:
    """`setting` (one of TOOL_PARSERS) made concrete for this tokenizer."""
    if setting not in TOOL_PARSERS:
        raise ValueError(f"tool parser {setting!r} is not one of {', '.join(TOOL_PARSERS)}")
    if setting == "auto":
        return detect_tool_parser(getattr(tokenizer, "chat_template", None))
    return setting


# SGLang's finish types as OpenAI's finish_reason ("abort" is SGLang's own, kept as is).
OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def openai_finish(finish_type: str, reply: ParsedReply | None = None) -> str:
    """OpenAI's finish_reason for a generation that ended with SGLang's `finish_type`; a
    chat reply that stopped on its own and holds tool calls finished with "tool_calls"."""
    finish = OPENAI_FINISH.get(finish_type, "stop")
    return "tool_calls" if reply is not None and reply.tool_calls and finish == "stop" else finish


def parse_chat_reply(text: str, request: Mapping[str, Any], parser: str) -> ParsedReply:
    """The reply to a chat `request`: tool calls are read with `parser` (a concrete one,
    see resolve_tool_parser) only when the request offers tools and tool_choice is not
    "none"."""
    offered = bool(request.get("tools")) and request.get("tool_choice") != "none"
    return parse_reply(text, parser if offered else "none")


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    """OpenAI's `choices[0].logprobs` of a chat reply: each token's text and logprob."""
    return {
        "content": [
            {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
            for tok, lp in zip(tokens, logprobs, strict=True)
        ]
    }


def parse_reply(text: str, parser: str) -> ParsedReply:
    """Content and tool calls of a generated reply (see the module docstring)."""
    calls = None
    if parser == "hermes":
        content, calls = _hermes(text)
    elif parser == "llama3":
        content, calls = None, _llama3(text)
    if not calls:
        return ParsedReply(text)
    ids = tuple(ToolCall(c.name, c.arguments, f"call_{uuid.uuid4().hex[:24]}") for c in calls)
    return ParsedReply(content, ids)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _hermes(text: str) -> tuple[str | None, list[ToolCall] | None]:
    blocks = _HERMES_BLOCK.findall(text)
    if not blocks:
        return text, None
    rest = _HERMES_BLOCK.sub("", text)
    if "<tool_call>" in rest or "</tool_call>" in rest:  # a block left open or unmatched
        return text, None
    calls = [_call(block, "arguments") for block in blocks]
    if any(c is None for c in calls):
        return text, None
    return (rest.strip() or None), calls  # type: ignore[return-value]


def _llama3(text: str) -> list[ToolCall] | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    calls = [_call(part, "parameters", "arguments") for part in _split_objects(body)]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _split_objects(body: str) -> list[str]:
    """`{...}; {...}` into its objects (a `;` inside a string or an object stays put)."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            _, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return [body]  # not a clean list of objects: one part, which fails to parse
        parts.append(body[i:end])
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return parts


def _call(raw: str, *argument_keys: str) -> ToolCall | None:
    try:
        obj = json.loads(raw.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


# --------------------------------------------------------------------------- rendering


def chat_prompt_ids(
    tokenizer: Any, messages: Any, tools: Any = None, chat_template_kwargs: Any = None
) -> list[int]:
    """Token ids of an OpenAI conversation with the generation prompt appended."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list")
    if not getattr(tokenizer, "chat_template", None):
        raise ChatRequestError("the served model's tokenizer has no chat template")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)
    ):
        raise ChatRequestError("tools must be a list of OpenAI tool objects")
    extra = dict(chat_template_kwargs or {})
    out = tokenizer.apply_chat_template(
        [template_message(m) for m in messages],
        tools=tools or None,
        add_generation_prompt=True,
        tokenize=True,
        **extra,
    )
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def template_message(message: Any) -> dict[str, Any]:
    """One OpenAI message as chat templates take it: content parts joined into text, and
    tool calls' `arguments` parsed from their JSON string."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise ChatRequestError("each message needs a role")
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    out: dict[str, Any] = {"role": str(message["role"]), "content": str(content)}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_template_call(c) for c in calls]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = str(message[key])
    return out


def _template_call(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ChatRequestError("a tool call in messages needs function.name")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as err:
            raise ChatRequestError(
                f"tool call {fn['name']!r} has arguments that are not JSON: {err}"
            ) from None
    return {
        "type": "function",
        "id": call.get("id"),
        "function": {"name": fn["name"], "arguments": args},
    }


def chat_chunks(envelope: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A finished `chat.completion` answer as the `chat.completion.chunk` objects of a
    streamed one: the role, the content, each tool call, then the finish reason (with the
    usage). Both fronts generate the whole reply first, then send it this way."""
    (choice,) = envelope["choices"]
    message = choice["message"]
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if message.get("content"):
        deltas.append({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or []):
        deltas.append({"tool_calls": [{"index": i, **call}]})
    head = {k: v for k, v in envelope.items() if k not in ("choices", "usage")}
    head["object"] = "chat.completion.chunk"
    chunks = [
        {**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas
    ]
    last = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    chunks.append({**head, "choices": [last], "usage": envelope.get("usage")})
    return chunks


async def send_sse(request: Any, chunks: list[dict[str, Any]]) -> Any:
    """Send `chunks` to an aiohttp `request` as server-sent events, as OpenAI's chat and
    completions stream them (`data: {...}` each, then `data: [DONE]`); the response."""
    frames = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return await _stream(request, frames + ["data: [DONE]\n\n"])


async def send_events(request: Any, events: list[tuple[str, dict[str, Any]]]) -> Any:
    """Send named `events` as the Responses and Messages APIs stream them (`event: NAME`
    and `data: {...}` each, no end marker); the response."""
    return await _stream(request, [f"event: {n}\ndata: {json.dumps(d)}\n\n" for n, d in events])


async def _stream(request: Any, frames: list[str]) -> Any:
    from aiohttp import web

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for frame in frames:
        await response.write(frame.encode())
    await response.write_eof()
    return response
