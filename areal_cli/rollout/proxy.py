"""The agent proxy: an OpenAI-compatible HTTP front of the run's inference servers that
records the exact tokens behind every completion an agent asks for.

An agent (areal_cli.rollout.agents) points the OpenAI SDK's `base_url` at its episode's
address, `http://HOST:PORT/e/<episode id>/v1`, and calls the API as it would call any
provider. Routes (also under `/v1/...` with the episode in an `X-Areal-Episode` header):
  POST /chat/completions   messages, tools, tool_choice, stream, and the sampling fields
  POST /completions        prompt (text or token ids)
  POST /responses          OpenAI's Responses API (areal_cli.data.responses): input items,
                           instructions, function tools and calls, previous_response_id
                           (within the episode), stream
  POST /messages           Anthropic's Messages API (areal_cli.data.messages): system,
                           text, tool_use and tool_result blocks, tools, stop_sequences,
                           stream; the Anthropic SDK's base_url is the episode's address
                           without its /v1
  GET  /models             the served model (any `model` name is accepted in requests)

For each request the proxy renders the chat template once (areal_cli.data.chat), sends
the token ids to the servers through the rollout client (so routing, retries, restarts
and weight versions apply as for any rollout), and records a `Completion`: the prompt ids
it sent, the output ids, logprobs and per-token weight versions the server returned.
Training samples are made from those records, never from text tokenized again.

Sampling: the request's max_tokens (or max_completion_tokens), temperature, top_p, top_k
and stop override the recipe's gconfig, which supplies the rest. The request's `seed` is
ignored: each completion gets the next seed of its episode, so the episodes of a group
differ and a resumed run draws the same. Stop strings end the reply at their first
occurrence; the tokens after the one that completes it are not kept (nor trained on).
Fields that change nothing here (user, metadata, parallel_tool_calls, stream_options,
store, ...) are accepted; ones the proxy cannot honour (n > 1, logit_bias, a JSON
response_format) get a 400 that names them.

Security: the proxy binds loopback unless told otherwise (`rollout.proxy.host`); bound
elsewhere it needs the run's API key on every route, as a Bearer token (OpenAI's SDK) or
an x-api-key header (Anthropic's).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from areal_cli.data import responses
from areal_cli.data.chat import (
    ChatRequestError,
    chat_chunks,
    chat_logprobs,
    chat_prompt_ids,
    openai_finish,
    parse_chat_reply,
    send_events,
    send_sse,
)
from areal_cli.data.messages import IGNORED as MESSAGES_IGNORED
from areal_cli.data.messages import OWN as MESSAGES_OWN
from areal_cli.data.messages import message_answer, message_events, to_chat
from areal_cli.data.requests import check_request, check_room, json_object
from areal_cli.rollout.workflows import token_versions

EPISODE_HEADER = "X-Areal-Episode"
_IGNORED = frozenset(
    {
        "model", "user", "metadata", "store", "parallel_tool_calls", "stream_options",
        "service_tier", "seed", "logprobs", "top_logprobs", "frequency_penalty",
        "presence_penalty", "stream", "n", "response_format", "logit_bias", "echo",
        "suffix", "best_of", "reasoning_effort", "modalities", "prediction",
    }
)  # fmt: skip
_SAMPLING = frozenset(
    {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop"}
)
_CHAT = frozenset({"messages", "tools", "tool_choice", "chat_template_kwargs"})

# generate(input_ids, sampling_params) -> SGLang's /generate answer (InferenceClient's)
Generate = Callable[[list[int], dict[str, Any]], Awaitable[dict[str, Any]]]


class ProxyRequestError(ValueError):
    """A request the proxy answers with a 400."""


@dataclass
class Completion:
    """What one request sent to the servers and what they returned."""

    id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # OpenAI's: stop, length, tool_calls (or SGLang's abort)
    text: str
    stop_sequence: str | None = None  # the request's stop string that ended it


@dataclass
class Episode:
    """One agent run's completions, in the order they were answered."""

    id: str
    seed: int
    completions: list[Completion] = field(default_factory=list)
    closed: bool = False
    # Responses API: each response's whole conversation, its output included, by id
    conversations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed - 1


class SessionRoutes(Protocol):
    """What the proxy asks of online sessions (areal_cli.rollout.online.OnlineSessions):
    their routes, who may call which route, and the episode a session's key names."""

    def add_routes(self, app: web.Application) -> None: ...

    def refuse(self, path: str, token: str | None) -> str | None: ...

    def episode_of(self, token: str | None) -> Episode: ...

    def handling(self, token: str | None) -> AbstractContextManager[None]: ...


@dataclass(frozen=True)
class ProxySettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    api_key: str = ""  # needed on every route when set
    served_model: str = "areal"
    context_length: int = 1024
    tool_parser: str = "none"  # concrete (areal_cli.data.chat.resolve_tool_parser)


class AgentProxy:
    """The proxy's HTTP server and its episode records (one per run, in the controller)."""

    def __init__(
        self,
        settings: ProxySettings,
        tokenizer: Any,
        generate: Generate,
        defaults: Mapping[str, Any],
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self._generate = generate
        self._defaults = dict(defaults)  # the recipe's gconfig as SGLang sampling_params
        self._episodes: dict[str, Episode] = {}
        self._runner: web.AppRunner | None = None
        self.port = settings.port
        self.created = int(time.time())
        self.last_request_at = 0.0  # time.monotonic() of the last completion asked for
        self.sessions: SessionRoutes | None = None  # rollout.mode online (it sets this)

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024**2)
        prefixes = ["/e/{episode}/v1", "/v1"]
        if self.sessions is not None:  # a session's key names it; AReaL's gateway paths too
            self.sessions.add_routes(app)
            prefixes = ["/v1", ""]
        for prefix in prefixes:
            app.router.add_post(prefix + "/chat/completions", self._chat)
            app.router.add_post(prefix + "/completions", self._completions)
            app.router.add_post(prefix + "/messages", self._messages)
            app.router.add_post(prefix + "/responses", self._responses)
            app.router.add_get(prefix + "/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def address(self) -> str:
        host = self.settings.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host  # noqa: S104 (what we dial)
        return f"http://{host}:{self.port}"

    def base_url(self, episode: Episode) -> str:
        return f"{self.address}/e/{episode.id}/v1"

    def open_episode(self, seed: int) -> Episode:
        episode = Episode(uuid.uuid4().hex, seed)
        self._episodes[episode.id] = episode
        return episode

    def close_episode(self, episode: Episode) -> list[Completion]:
        """Forget the episode; a request for it afterwards gets a 404. Its records."""
        episode.closed = True
        self._episodes.pop(episode.id, None)
        return list(episode.completions)

    # ------------------------------------------------------------------ routes

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key, given = self.settings.api_key, request_key(request)
        if self.sessions is not None:  # online: the admin key, or a session's own
            refused = self.sessions.refuse(request.path, given)
            if refused is not None:
                return error_answer(401, refused)
            handling = self.sessions.handling(given)  # its session is busy till answered
        else:
            handling = nullcontext()
            if key and given != key:
                return error_answer(401, "a valid API key is needed (Authorization: Bearer KEY)")
        try:
            with handling:
                return await handler(request)
        except (ProxyRequestError, ChatRequestError) as err:
            return error_answer(400, str(err))

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.settings.served_model,
            "object": "model",
            "created": self.created,
            "owned_by": "areal",
            "max_model_len": self.settings.context_length,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        episode, body = await self._request(request, _CHAT)
        prompt = chat_prompt_ids(
            self.tokenizer,
            body.get("messages"),
            body.get("tools"),
            body.get("chat_template_kwargs"),
        )
        done = await self._complete(episode, prompt, body)
        reply = parse_chat_reply(done.text, body, self.settings.tool_parser)
        # stop, length and abort are their own OpenAI names, so this only adds tool_calls
        done.finish_reason = openai_finish(done.finish_reason, reply)
        choice = {
            "index": 0,
            "message": reply.message(),
            "logprobs": chat_logprobs(
                [self.tokenizer.decode([t]) for t in done.output_ids], done.logprobs
            )
            if body.get("logprobs")
            else None,
            "finish_reason": done.finish_reason,
        }
        answer = self._envelope("chat.completion", done, [choice])
        if body.get("stream"):
            return await send_sse(request, chat_chunks(answer))
        return web.json_response(answer)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API over the same completion record as chat."""
        episode, body = await self._request(request, MESSAGES_OWN, MESSAGES_IGNORED)
        messages, tools, choice = to_chat(body)
        if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
            raise ProxyRequestError("max_tokens (a positive integer) is required")
        prompt = chat_prompt_ids(self.tokenizer, messages, tools)
        sampling = {
            k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k") if k in body
        }
        sampling["stop"] = body.get("stop_sequences")
        done = await self._complete(episode, prompt, sampling)
        reply = parse_chat_reply(
            done.text, {"tools": tools, "tool_choice": choice}, self.settings.tool_parser
        )
        done.finish_reason = openai_finish(done.finish_reason, reply)
        answer = message_answer(
            reply, done.finish_reason, done.stop_sequence,
            (len(done.prompt_ids), len(done.output_ids)), self.settings.served_model,
            done.id,
        )  # fmt: skip
        if body.get("stream"):
            return await send_events(request, message_events(answer))
        return web.json_response(answer)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API over the same completion record as chat; the episode
        keeps each response's conversation for previous_response_id."""
        episode, body = await self._request(request, responses.OWN, responses.IGNORED)
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if previous not in episode.conversations:
                raise ProxyRequestError(
                    f"previous_response_id {previous!r} is no response of this episode"
                )
            history = list(episode.conversations[previous])
        turns = responses.input_messages(body)
        system = (
            [{"role": "system", "content": body["instructions"]}]
            if body.get("instructions")
            else []
        )
        tools = responses.chat_tools(body.get("tools"))
        choice = responses.chat_tool_choice(body.get("tool_choice"))
        prompt = chat_prompt_ids(self.tokenizer, system + history + turns, tools)
        sampling = {"max_tokens": body.get("max_output_tokens")}
        sampling.update({k: body[k] for k in ("temperature", "top_p") if k in body})
        done = await self._complete(episode, prompt, sampling)
        done.id = f"resp_{uuid.uuid4().hex}"
        reply = parse_chat_reply(
            done.text, {"tools": tools, "tool_choice": choice}, self.settings.tool_parser
        )
        done.finish_reason = openai_finish(done.finish_reason, reply)
        episode.conversations[done.id] = history + turns + [responses.as_chat_message(reply)]
        answer = responses.response_answer(
            body, done.id, responses.output_items(reply), done.finish_reason,
            (len(done.prompt_ids), len(done.output_ids)), self.settings.served_model,
        )  # fmt: skip
        if body.get("stream"):
            return await send_events(request, responses.response_events(answer))
        return web.json_response(answer)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        episode, body = await self._request(request, frozenset({"prompt"}))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str) and prompt:
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            raise ProxyRequestError("prompt must be a non-empty string or list of token ids")
        done = await self._complete(episode, ids, body)
        choice = {
            "index": 0,
            "text": done.text,
            "logprobs": None,
            "finish_reason": done.finish_reason,
        }
        if body.get("stream"):
            return await send_sse(request, [self._envelope("text_completion", done, [choice])])
        return web.json_response(self._envelope("text_completion", done, [choice]))

    # ------------------------------------------------------------------ the work

    async def _request(
        self, request: web.Request, own: frozenset[str], ignored: frozenset[str] | None = None
    ) -> tuple[Episode, dict[str, Any]]:
        if self.sessions is not None:
            episode = self.sessions.episode_of(request_key(request))
        else:
            eid = request.match_info.get("episode") or request.headers.get(EPISODE_HEADER, "")
            episode = self._episodes.get(eid)
            if episode is None:
                raise not_found(f"no open episode {eid!r} at this proxy")
        body = await json_object(request, ProxyRequestError, empty=False)
        allowed = own | (_IGNORED | _SAMPLING if ignored is None else ignored)
        _refuse(body, allowed)
        if ignored is None:  # an OpenAI chat or completions body
            check_request(body, "chat" if "messages" in own else "completions")
        return episode, body

    def _sampling(self, episode: Episode, body: Mapping[str, Any], n_prompt: int) -> dict:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        check_room(limit, n_prompt, self.settings.context_length)
        room = self.settings.context_length - n_prompt
        params = dict(self._defaults)
        for ours, theirs in (
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
        ):
            if body.get(theirs) is not None:
                params[ours] = body[theirs]
        if limit is not None:
            params["max_new_tokens"] = int(limit)
        params["max_new_tokens"] = min(int(params.get("max_new_tokens", room)), room)
        params["sampling_seed"] = episode.next_seed()
        return params

    async def _complete(self, episode: Episode, prompt: list[int], body: Mapping) -> Completion:
        params = self._sampling(episode, body, len(prompt))
        self.last_request_at = time.monotonic()
        answer = await self._generate(prompt, params)
        if episode.closed:  # the episode ended (timeout) while this request ran
            raise web.HTTPGone(text="the episode is over")
        meta = answer.get("meta_info", {})
        ids = list(answer.get("output_ids", []))
        logprobs = [float(lp[0]) for lp in meta.get("output_token_logprobs", [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"server returned {len(ids)} tokens but {len(logprobs)} logprobs")
        versions = token_versions(meta, len(ids))
        finish = openai_finish((meta.get("finish_reason") or {}).get("type", ""))
        text = answer.get("text", "")
        stops, hit = _stops(body.get("stop")), None
        if stops:
            ids, text, finish, hit = self._cut_at_stop(ids, text, stops, finish)
            logprobs, versions = logprobs[: len(ids)], versions[: len(ids)]
        done = Completion(
            f"chatcmpl-{uuid.uuid4().hex}", list(prompt), ids, logprobs, versions, finish, text,
            hit,
        )  # fmt: skip
        episode.completions.append(done)
        return done

    def _cut_at_stop(
        self, ids: list[int], text: str, stops: list[str], finish: str
    ) -> tuple[list[int], str, str, str | None]:
        """The reply up to the first stop string (excluded from the text), the fewest
        tokens whose text holds it, and the stop string (None: none occurred)."""
        at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if at < 0:
            return ids, text, finish, None
        hit = next(s for s in stops if text.find(s) == at)
        for n in range(1, len(ids) + 1):
            if hit in self.tokenizer.decode(ids[:n], skip_special_tokens=True):
                return ids[:n], text[:at], "stop", hit
        return ids, text[:at], "stop", hit

    # ------------------------------------------------------------------ answers

    def _envelope(self, kind: str, done: Completion, choices: list[dict]) -> dict[str, Any]:
        n_prompt, n_out = len(done.prompt_ids), len(done.output_ids)
        return {
            "id": done.id,
            "object": kind,
            "created": int(time.time()),
            "model": self.settings.served_model,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
            },
        }


def _refuse(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """A 400 for a field the route neither reads nor may ignore (not in `allowed`), and
    for the values the proxy cannot honour."""
    for key in body:
        if key not in allowed:
            raise ProxyRequestError(
                f"'{key}' is not supported by areal's agent proxy; leave it out"
            )
    if body.get("n") not in (None, 1):
        raise ProxyRequestError("'n' above 1 is not supported; send one request per sample")
    if body.get("logit_bias"):
        raise ProxyRequestError("'logit_bias' is not supported; leave it out")
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        raise ProxyRequestError(
            f"response_format {fmt.get('type')!r} is not supported: the proxy does not "
            "constrain decoding; ask for the format in the prompt"
        )


def _stops(stop: Any) -> list[str]:
    if stop is None or stop == "":
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise ProxyRequestError("stop must be a string or a list of strings")


def request_key(request: web.Request) -> str | None:
    """The request's API key: a Bearer token (OpenAI's SDK) or x-api-key (Anthropic's)."""
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth.removeprefix("Bearer ").strip()
    return request.headers.get("x-api-key")


def not_found(message: str) -> web.HTTPNotFound:
    return web.HTTPNotFound(
        text=json.dumps({"error": {"message": message, "code": 404}}),
        content_type="application/json",
    )


def bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(
        text=json.dumps({"error": {"message": message, "code": 400}}),
        content_type="application/json",
    )


def error_answer(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
        status=status,
    )
