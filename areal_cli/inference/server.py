"""HTTP server around `InferenceEngine`: SGLang's native routes plus an OpenAI-compatible subset.

Usage: python -m areal_cli.inference.server --model-path PATH [--host 127.0.0.1] [--port 30000]
       [--dtype float32|bfloat16] [--weight-version V] [--max-running-requests M]
       [--api-key K] [--served-model-name NAME] [--random-seed S] [--device auto|cpu|cuda]
       [--schedule-policy lof|fcfs] [--watch-weights DIR] [--weight-root DIR ...]
       [--context-length N] [--tool-call-parser auto|hermes|llama3|none]
       [--insecure-no-api-key]

Native routes (SGLang names and bodies): /generate, /update_weights_from_disk,
/load_lora_adapter and /unload_lora_adapter (one adapter at a time, merged into the
weights; a request's lora_path must name it), /pause_generation, /continue_generation, /abort_request, /update_weight_version,
/release_memory_occupation, /resume_memory_occupation (areal_cli.inference.memory),
/flush_cache, /health, /health_generate, /model_info, /get_model_info, /server_info.
OpenAI routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(n=1; `stream` sends the whole reply as OpenAI's chunks once it is generated; `stop`
strings and top alternatives are not supported, and any field a route does not honour is
refused with a 400 naming it, never dropped; every value is checked by
areal_cli.data.requests, so a bad one is a 400 naming the field). The chat route
takes `tools` and answers parsed `tool_calls` (areal_cli.data.chat; --tool-call-parser,
from the chat template by default).
With --api-key every route except /health and /health_generate needs
`Authorization: Bearer KEY`. The port is bound only after the model has loaded, so a 200
from /health means ready. SIGINT/SIGTERM stop it cleanly (in-flight requests are aborted).
/update_weights_from_disk loads only from inside --weight-root folders (403 otherwise), and
a host beyond loopback needs --api-key (areal_cli.inference.guards). A 500 carries a
request id; its traceback is in this server's log only.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import hmac
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from areal_cli.config.schema import DTYPES
from areal_cli.data.chat import (
    TOOL_PARSERS,
    chat_chunks,
    chat_logprobs,
    chat_prompt_ids,
    openai_finish,
    parse_chat_reply,
    resolve_tool_parser,
    send_sse,
)
from areal_cli.data.requests import check_request, check_room, json_object
from areal_cli.inference.api import GenerateOutput, GenerateRequest, SamplingParams
from areal_cli.inference.engine import InferenceEngine
from areal_cli.inference.guards import bind_problem, weight_path_problem
from areal_cli.inference.memory import resident_mb
from areal_cli.inference.threads import one_core
from areal_cli.inference.weight_receiver import ReceiveError, WeightReceiver

T = TypeVar("T")
logger = logging.getLogger("areal_cli.inference.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_ROUTES = frozenset({"/health", "/health_generate"})
# OpenAI finish reasons; an aborted request reports SGLang's "abort".


class BadRequest(ValueError):
    """A client error reported as HTTP 400."""


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object body, {} when empty."""
    return await json_object(request, BadRequest)


async def _in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a daemon thread: a join or receive blocked in the weight-update
    group (waiting for a member that died, up to the timeout) must not keep the process
    alive after SIGTERM, as a thread of asyncio's default executor would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, failed: bool) -> None:
        if not future.done():
            (future.set_exception if failed else future.set_result)(value)

    def run() -> None:
        try:
            one_core()  # the scheduler's kernels keep their spinning workers (threads.py)
            result, failed = fn(*args), False
        except BaseException as exc:  # handed to the awaiting request
            result, failed = exc, True
        try:
            loop.call_soon_threadsafe(settle, result, failed)
        except RuntimeError:  # the loop closed meanwhile: the server is stopping
            pass

    threading.Thread(target=run, name="areal-weight-group", daemon=True).start()
    return await future


def _refusal(message: str) -> web.Response:
    """A weight-group request this server cannot serve, in SGLang's answer shape."""
    return web.json_response({"success": False, "message": message}, status=400)


class InferenceServer:
    """Route handlers bound to one engine."""

    def __init__(
        self,
        engine: InferenceEngine,
        served_model_name: str,
        api_key: str | None,
        weight_roots: list[str] | None = None,
        tool_parser: str = "auto",
        dist_timeout_s: float = 600.0,
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.weight_roots = list(weight_roots or [])
        self.created = int(time.time())
        self.tool_parser = resolve_tool_parser(tool_parser, engine.tokenizer)
        self.receiver: WeightReceiver | None = None  # made on the first join
        self.dist_timeout_s = dist_timeout_s
        self.adapter: str | None = None  # the LoRA adapter /load_lora_adapter merged in

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors, self._auth], client_max_size=64 * 1024 * 1024
        )
        routes = [
            ("POST", "/generate", self.generate),
            ("PUT", "/generate", self.generate),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("POST", "/load_lora_adapter", self.load_lora_adapter),
            ("POST", "/unload_lora_adapter", self.unload_lora_adapter),
            ("POST", "/init_weights_update_group", self.init_weights_update_group),
            ("POST", "/update_weights_from_distributed", self.update_weights_from_distributed),
            ("POST", "/destroy_weights_update_group", self.destroy_weights_update_group),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation),
            ("POST", "/abort_request", self.abort_request),
            ("POST", "/update_weight_version", self.update_weight_version),
            ("POST", "/release_memory_occupation", self.release_memory_occupation),
            ("POST", "/resume_memory_occupation", self.resume_memory_occupation),
            ("POST", "/flush_cache", self.flush_cache),
            ("GET", "/flush_cache", self.flush_cache),
            ("GET", "/weights_checksum", self.weights_checksum),
            ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health),
            ("GET", "/model_info", self.model_info),
            ("GET", "/get_model_info", self.model_info),
            ("GET", "/server_info", self.server_info),
            ("GET", "/get_server_info", self.server_info),
            ("GET", "/v1/models", self.list_models),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/chat/completions", self.chat_completions),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.api_key and request.path not in OPEN_ROUTES:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return _error(401, "missing or wrong API key", "authentication_error")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except ValueError as exc:  # BadRequest and engine validation errors
            return _error(400, str(exc))
        except RuntimeError as exc:  # the engine is shutting down
            return _error(503, str(exc), "service_unavailable")
        except Exception:
            # the traceback stays in the server's log; the client gets an id to find it by
            request_id = uuid.uuid4().hex[:12]
            logger.exception("error while serving %s (request id %s)", request.path, request_id)
            message = f"internal server error (request id {request_id}; see the server log)"
            return _error(500, message, "internal_error")

    # ------------------------------------------------------------------ native routes

    async def generate(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("stream"):
            raise BadRequest("streaming is not supported by this server")
        items = _split_batch(body)
        for item in items:
            named = item.get("lora_path")
            if named is not None and named != self.adapter:
                serving = f"adapter {self.adapter!r}" if self.adapter else "no adapter"
                raise BadRequest(
                    f"lora_path {named!r} is not loaded: this server serves {serving} (one "
                    "at a time, merged into its weights; /load_lora_adapter loads another)"
                )
        reqs = [GenerateRequest.from_dict(item) for item in items]
        outs = await asyncio.gather(*(self.engine.generate(r) for r in reqs))
        results = [o.to_dict(r.return_logprob) for o, r in zip(outs, reqs, strict=True)]
        return web.json_response(results if _is_batch(body) else results[0])

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if not body.get("model_path"):
            raise BadRequest("model_path is required")
        refused = weight_path_problem(str(body["model_path"]), self.weight_roots)
        if refused:
            logger.warning("refused /update_weights_from_disk: %s", refused)
            content = {
                "success": False,
                "message": refused,
                "num_paused_requests": 0,
                "weight_version": self.engine.weight_version,  # unchanged
            }
            return web.json_response(content, status=403)
        # flush_cache is accepted and ignored: this engine keeps no prefix cache.
        update = self.engine.submit_weight_update(
            body["model_path"],
            body.get("weight_version"),
            abort_all_requests=bool(body.get("abort_all_requests", False)),
        )
        ok, message, stats = await asyncio.wrap_future(update)
        if ok:
            self.adapter = None  # what it loaded is the whole model now, named by no adapter
        paused = stats.num_running + stats.num_waiting if stats.paused else 0
        # SGLang's three fields, plus the version now served (saves a /model_info call).
        content = {
            "success": ok,
            "message": message,
            "num_paused_requests": paused,
            "weight_version": stats.weight_version,
        }
        return web.json_response(content, status=200 if ok else 400)

    # LoRA, SGLang's routes and answers (LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput):
    # this server holds one adapter at a time, merged into its weights (weight_loader), so
    # a load is a weight update whose version label stays; unload goes back to the base.

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise BadRequest("lora_name and lora_path are required")
        if refused := weight_path_problem(str(path), self.weight_roots):
            return web.json_response({"success": False, "error_message": refused}, status=403)
        ok, message, _ = await asyncio.wrap_future(self.engine.submit_weight_update(path))
        if not ok:
            return web.json_response({"success": False, "error_message": message}, status=400)
        self.adapter = str(name)
        return web.json_response({"success": True, "loaded_adapters": {self.adapter: str(path)}})

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        name = (await _body(request)).get("lora_name")
        if name is None or name != self.adapter:
            message = f"adapter {name!r} is not loaded (loaded: {self.adapter!r})"
            return web.json_response({"success": False, "error_message": message}, status=400)
        base = self.engine.base_path
        ok, message, _ = await asyncio.wrap_future(self.engine.submit_weight_update(base))
        if ok:
            self.adapter = None
        return web.json_response(
            {"success": ok, "error_message": None if ok else message, "loaded_adapters": {}},
            status=200 if ok else 500,
        )

    # The distributed weight update (areal_cli.inference.weight_receiver): SGLang's routes
    # and answers. Like a load from disk, it needs a server allowed to load weights.

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if not self.weight_roots:
            return _refusal(
                "this server loads no weights over HTTP: it was started without --weight-root"
            )
        if self.receiver is None:
            self.receiver = WeightReceiver(self.engine.device, self.dist_timeout_s)
        try:
            message = await _in_daemon_thread(self.receiver.join, body)
        except ReceiveError as exc:
            return _refusal(str(exc))
        except Exception as exc:  # the rendezvous failed: a member never came, a bad address
            logger.warning("joining the weight-update group failed: %s", exc)
            return _refusal(f"joining the weight-update group failed: {exc}")
        return web.json_response({"success": True, "message": message})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if self.receiver is None:
            return _refusal(
                "this server is in no weight-update group: call /init_weights_update_group first"
            )
        try:
            version = await _in_daemon_thread(self.receiver.receive, body)
        except ReceiveError as exc:
            logger.warning("%s", exc)
            return _refusal(str(exc))
        if version is None:  # staged; the bucket with weight_version swaps them in
            content = {"success": True, "message": f"received {len(body['names'])} tensors"}
            return web.json_response(content)
        update = self.engine.submit_received_weights(
            version,
            str(body["weight_version"]),
            abort_all_requests=bool(body.get("abort_all_requests", False)),
        )
        ok, message, stats = await asyncio.wrap_future(update)
        content = {"success": ok, "message": message, "weight_version": stats.weight_version}
        return web.json_response(content, status=200 if ok else 400)

    async def weights_checksum(self, request: web.Request) -> web.Response:
        """areal's own: the CRC-32 of the weights in use, as the model.safetensors of an
        exported folder (its manifest's checksum), and their version."""
        crc, version = await asyncio.to_thread(self.engine.weights_crc32)
        return web.json_response({"crc32": crc, "weight_version": version})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        await _body(request)
        if self.receiver is not None:
            await asyncio.to_thread(self.receiver.leave)
        return web.json_response({"success": True, "message": "left the weight-update group"})

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await _body(request)).get("mode", "abort")
        await asyncio.to_thread(self.engine.pause, mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await asyncio.to_thread(self.engine.continue_generation)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("abort_all"):
            count = await asyncio.to_thread(self.engine.abort_all)
        elif body.get("rid"):
            count = int(await asyncio.to_thread(self.engine.abort, str(body["rid"])))
        else:
            raise BadRequest("give rid or abort_all")
        return web.json_response({"success": True, "num_aborted": count})

    # Colocated runs (areal_cli.inference.memory): SGLang's routes and bodies, {"tags":
    # ["weights", "kv_cache"]} or no tags for both; a release needs an idle server.
    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = (await _body(request)).get("tags")
        message = await asyncio.to_thread(self.engine.release_memory_occupation, tags)
        return web.json_response({"success": True, "message": message})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = (await _body(request)).get("tags")
        message = await asyncio.to_thread(self.engine.resume_memory_occupation, tags)
        return web.json_response({"success": True, "message": message})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("new_version") is None:
            raise BadRequest("new_version is required")
        version = str(body["new_version"])
        abort = bool(body.get("abort_all_requests", True))
        await asyncio.to_thread(self.engine.update_weight_version, version, abort)
        message = f"Weight version updated to {version}"
        return web.json_response({"success": True, "message": message, "new_version": version})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.engine.flush_cache()
        return web.Response(text="Cache flushed.\n")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.is_alive() else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.engine.config
        return web.json_response(
            {
                "model_path": self.engine.model_path,
                "tokenizer_path": self.engine.model_path,
                "served_model_name": self.served_model_name,
                "is_generation": True,
                "weight_version": self.engine.weight_version,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None),
                "context_length": self.engine.context_length,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        stats = await asyncio.to_thread(self.engine.stats)
        return web.json_response(
            {
                "model_path": stats.model_path,
                "weight_version": stats.weight_version,
                "paused": stats.paused,
                "num_running_reqs": stats.num_running,
                "num_waiting_reqs": stats.num_waiting,
                "max_running_requests": self.engine.max_running_requests,
                "device": str(self.engine.device),
                "dtype": str(self.engine.model.dtype).removeprefix("torch."),
                "memory_released": sorted(self.engine.released),
                "resident_mb": round(resident_mb(), 1),
                "kv_cache_mb": round(stats.kv_cache_bytes / 2**20, 1),
            }
        )

    # ------------------------------------------------------------------ OpenAI routes

    async def list_models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "areal",
            "root": self.served_model_name,
            "max_model_len": self.engine.context_length,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        refuse_unsupported(body, COMPLETION_FIELDS)
        check_request(body, "completions")
        prompts = _completion_prompts(body.get("prompt"))
        reqs = [self._openai_request(body, prompt) for prompt in prompts]
        outs = await asyncio.gather(*(self.engine.generate(r) for r in reqs))
        choices = [
            {
                "index": i,
                "text": out.text,
                "logprobs": self._completion_logprobs(out)
                if body.get("logprobs") is not None
                else None,
                "finish_reason": openai_finish(out.finish_reason["type"]),
            }
            for i, out in enumerate(outs)
        ]
        answer = self._openai_envelope("text_completion", "cmpl", choices, outs)
        if body.get("stream"):
            return await send_sse(request, [answer])
        return web.json_response(answer)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        refuse_unsupported(body, CHAT_FIELDS)
        check_request(body, "chat")  # ChatRequestError is a ValueError: a 400
        prompt = chat_prompt_ids(self.engine.tokenizer, body.get("messages"), body.get("tools"))
        out = await self.engine.generate(self._openai_request(body, prompt))
        reply = parse_chat_reply(out.text, body, self.tool_parser)
        choice = {
            "index": 0,
            "message": reply.message(),
            "logprobs": chat_logprobs(self._token_strings(out), out.output_logprobs)
            if body.get("logprobs")
            else None,
            "finish_reason": openai_finish(out.finish_reason["type"], reply),
        }
        answer = self._openai_envelope("chat.completion", "chatcmpl", [choice], [out])
        if body.get("stream"):
            return await send_sse(request, chat_chunks(answer))
        return web.json_response(answer)

    def _openai_request(self, body: dict[str, Any], prompt: str | list[int]) -> GenerateRequest:
        """Map OpenAI sampling fields (plus SGLang extras), checked already
        (`refuse_unsupported`, data.requests), onto a GenerateRequest."""
        params = SamplingParams.from_dict(
            {
                "temperature": body.get("temperature"),
                "top_p": body.get("top_p"),
                "top_k": body.get("top_k"),
                "sampling_seed": body.get("seed"),
                "stop_token_ids": body.get("stop_token_ids"),
                "ignore_eos": body.get("ignore_eos"),
                "frequency_penalty": body.get("frequency_penalty") or 0,
                "presence_penalty": body.get("presence_penalty") or 0,
            }
        )
        if isinstance(prompt, str):
            ids = self.engine.tokenizer(prompt)["input_ids"]
        else:
            ids = prompt
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        check_room(limit, len(ids), self.engine.context_length)
        # OpenAI's default is "as long as the context allows".
        params = replace(params, max_new_tokens=int(limit or self.engine.context_length - len(ids)))
        return GenerateRequest(input_ids=list(ids), sampling_params=params, return_logprob=True)

    def _openai_envelope(
        self, kind: str, prefix: str, choices: list[dict[str, Any]], outs: list[GenerateOutput]
    ) -> dict[str, Any]:
        prompt_tokens = sum(len(o.prompt_ids) for o in outs)
        completion_tokens = sum(len(o.output_ids) for o in outs)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "metadata": {"weight_version": outs[0].weight_version if outs else None},
        }

    def _token_strings(self, out: GenerateOutput) -> list[str]:
        return [self.engine.tokenizer.decode([t]) for t in out.output_ids]

    def _completion_logprobs(self, out: GenerateOutput) -> dict[str, Any]:
        tokens = self._token_strings(out)
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": out.output_logprobs,
            "top_logprobs": None,
            "text_offset": offsets,
        }


# --------------------------------------------------------------------------- request shapes

# The fields the OpenAI routes honour. Any other is refused with a 400 that names it, so no
# field a client sends is silently dropped.
_OPENAI_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
        "stop_token_ids", "ignore_eos", "frequency_penalty", "presence_penalty", "logprobs",
        "n", "stream", "user",
    }
)  # fmt: skip
CHAT_FIELDS = _OPENAI_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
}  # fmt: skip
COMPLETION_FIELDS = _OPENAI_FIELDS | {"prompt"}
_WHY = {
    "functions": "the legacy functions field is not supported; send tools",
    "function_call": "the legacy function_call field is not supported; send tool_choice",
}


def refuse_unsupported(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """BadRequest naming the first field (or value) of an OpenAI request that this server
    cannot honour: unknown fields, n > 1, stop strings, top alternatives."""
    for key in body:
        if key not in allowed:
            raise BadRequest(
                f"'{key}' is not supported: {_WHY.get(key, 'this server does not implement it')}; "
                "leave it out"
            )
    if body.get("n") not in (None, 1):
        raise BadRequest("'n' is not supported above 1; send one request per sample")
    if body.get("stop"):
        raise BadRequest("'stop' strings are not supported; use stop_token_ids")
    if body.get("top_logprobs") not in (None, 0):
        raise BadRequest(
            "'top_logprobs' is not supported: only the sampled tokens' logprobs are returned"
        )
    if "prompt" in body and body.get("logprobs") not in (None, 0, False):
        raise BadRequest(
            "'logprobs' above 0 asks for top alternatives, which are not returned; "
            "use logprobs=0 for the sampled tokens' logprobs"
        )


def _is_batch(body: dict[str, Any]) -> bool:
    ids, text = body.get("input_ids"), body.get("text")
    return isinstance(text, list) or (
        isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    )


def _split_batch(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Split a batched /generate body into single-request bodies (SGLang's batch form)."""
    if not _is_batch(body):
        return [body]
    prompts = body["text"] if isinstance(body.get("text"), list) else body["input_ids"]
    key = "text" if isinstance(body.get("text"), list) else "input_ids"
    n = len(prompts)

    def pick(name: str, i: int) -> Any:
        value = body.get(name)
        if isinstance(value, list) and len(value) == n and name != "stop_token_ids":
            return value[i]
        return value

    rid = body.get("rid")
    items = []
    for i, prompt in enumerate(prompts):
        item_rid = rid[i] if isinstance(rid, list) else (f"{rid}-{i}" if rid else None)
        items.append(
            {
                key: prompt,
                "sampling_params": pick("sampling_params", i),
                "return_logprob": pick("return_logprob", i),
                "rid": item_rid,
            }
        )
    return items


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI `prompt`: a string, a token list, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) for p in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) for p in prompt):
            return list(prompt)
    raise BadRequest("prompt must be a string, a list of token ids, or a list of those")


# --------------------------------------------------------------------------- process


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="areal's CPU/GPU inference server")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--max-running-requests", type=int, default=32)
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="Longest prompt plus reply in tokens; default: the model's max_position_embeddings.",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS,
        default="auto",
        help="How the chat route reads tool calls from replies; auto: from the chat template.",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("AREAL_API_KEY") or None,
        help="Bearer token every route but /health needs; default: $AREAL_API_KEY (keep it "
        "there: a command line is visible to every user of the machine).",
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=600.0,
        help="Seconds a weight-update group's join or broadcast may wait (SGLang's flag).",
    )
    parser.add_argument(
        "--schedule-policy",
        choices=["lof", "fcfs"],
        default="lof",
        help="Order in which queued requests join the batch (longest remaining first "
        "keeps the batch full; requests queued over 10 s go first either way).",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--watch-weights",
        metavar="DIR",
        default=None,
        help="Read ahead every weights entry renamed into DIR (a run's weights/ folder) "
        "while generating, so /update_weights_from_disk for it only swaps (CPU only; not "
        "an SGLang flag).",
    )
    parser.add_argument(
        "--weight-root",
        metavar="DIR",
        action="append",
        default=[],
        help="A folder /update_weights_from_disk may load from (repeatable; --watch-weights "
        "DIR counts as one). Without any, the server loads no weights over HTTP.",
    )
    parser.add_argument(
        "--insecure-no-api-key",
        action="store_true",
        help="Listen beyond loopback without an API key (refused otherwise).",
    )
    parser.add_argument(
        "--disable-decode-cuda-graph",
        "--disable-cuda-graph",
        action="store_true",
        help="Decode without CUDA graphs on a GPU (SGLang's flags; a CPU never captures them).",
    )
    parser.add_argument(
        "--cuda-graph-max-bs-decode",
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="Largest batch a decode graph is captured for; default: --max-running-requests.",
    )
    parser.add_argument("--log-level", default="info")
    return parser


async def serve(args: argparse.Namespace) -> None:
    """Load the engine, serve until SIGINT/SIGTERM, then shut down cleanly."""
    engine = await asyncio.to_thread(
        InferenceEngine,
        args.model_path,
        dtype=args.dtype,
        device=args.device,
        max_running_requests=args.max_running_requests,
        weight_version=args.weight_version,
        random_seed=args.random_seed,
        schedule_policy=args.schedule_policy,
        context_length=args.context_length,
        decode_graphs="off" if args.disable_decode_cuda_graph else "auto",
        cuda_graph_max_bs=args.cuda_graph_max_bs_decode,
    )
    if args.watch_weights:
        engine.watch_for_weights(args.watch_weights)
    name = args.served_model_name or args.model_path
    roots = args.weight_root + ([args.watch_weights] if args.watch_weights else [])
    server = InferenceServer(
        engine, name, args.api_key, roots, args.tool_call_parser, args.dist_timeout
    )
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, args.host, args.port).start()
        logger.info(
            "serving %s as %r on http://%s:%d",
            Path(args.model_path).name,
            name,
            args.host,
            args.port,
        )
        await stop.wait()
        logger.info("shutting down")
    finally:
        await asyncio.to_thread(engine.shutdown)
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    refused = bind_problem(args.host, args.api_key, args.insecure_no_api_key)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve(args))
    except OSError as exc:  # e.g. the port is taken
        if exc.errno == errno.EADDRINUSE:
            logger.error("port %d on %s is already in use by another process", args.port, args.host)
        else:
            logger.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
