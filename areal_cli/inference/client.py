"""One async client for a fleet of inference servers that speak SGLang's native HTTP API.

Every call is SGLang's (token ids in; token ids, logprobs and weight versions out), and
the backend object (`inference.backends`, looked up by the name given as `backend`) maps
it onto its server's routes and its answers back: SGLang and the embedded server answer
those routes themselves, vLLM in its own words. A weight update is the backend's sequence
of calls. So one client serves every backend, and the rollout does not change.

Routing: `generate` goes to one server, picked round-robin or least-loaded (fewest
requests this client has in flight there, ties broken round-robin). Control calls
(weight updates, pause/continue, abort, model info) go to every server.

Failures: a connection error, a timeout or an HTTP 5xx is retried up to `retries` times
with exponential backoff; a `generate` retry prefers a server it has not tried yet. An
HTTP 4xx is the caller's fault and is raised at once as `RequestRejected`. When retries
run out, `ServerUnavailable` names the server(s), says what went wrong and points to the
server's log when the client was given one.

Identity: a client made with `served_model` (a run's: launch.plan.served_name) takes a
server only once its /v1/models lists that name (`wait_healthy`, `check_identity`). A
server that answers with another name, or refuses the run's key, holds a port of this run
without being one of its servers (another run's, started at the same moment), and is
`ForeignServer`, never a silent stand-in.

Restarts: the controller takes a server that died out of routing (`set_down`) until its
new process is healthy and holds the current weights (`set_up`). Meanwhile `generate`
goes to the other servers, or waits for one to come back; an attempt that failed on the
server that died is re-issued without counting as a retry (`reissued` counts them), and
calls to every server skip it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from areal_cli.inference.backends import backend_for
from areal_cli.inference.backends.base import WENT_DOWN, NoAnswer, accepted, error_message
from areal_cli.rundir.layout import adapter_problem, is_adapter_folder

Policy = Literal["round_robin", "least_loaded"]
POLICIES: tuple[str, ...] = ("round_robin", "least_loaded")
MAX_BACKOFF_S = 10.0
# Seconds an idle pooled connection is reused for: below the 5 s after which uvicorn (the
# HTTP server of SGLang and vLLM) closes an idle keep-alive connection. aiohttp's own 15 s
# let a call go out on a connection the server was closing at that moment: the call then
# failed with "the connection was closed before an answer" (seen on vLLM's /pause, a
# one-attempt call, ~15 s after the previous control call, on a loaded 2-core host).
KEEPALIVE_S = 2.0


class InferenceError(RuntimeError):
    """Base class of the client's errors."""


class ServerUnavailable(InferenceError):
    """A server did not answer (connection error, timeout or HTTP 5xx) after the retries."""


class RequestRejected(InferenceError):
    """A server answered HTTP 4xx: the request itself is wrong, so it is not retried."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ForeignServer(InferenceError):
    """A server at one of the run's addresses is not one of the run's servers."""


class WeightUpdateFailed(InferenceError):
    """A server refused `/update_weights_from_disk` (it answered success: false)."""


@dataclass
class _Server:
    address: str
    log: str | None
    inflight: int = 0  # /generate requests, for least_loaded routing
    pending: dict[str, int] = field(default_factory=dict)  # every call in flight, by path
    last_done: float = field(default_factory=time.time)  # wall time a call was last answered
    down: bool = False  # restarting: out of routing (see InferenceClient.set_down)
    epoch: int = 0  # how many times it was taken down


class _Link:
    """One server as a backend reaches it (backends.base.Link): the client's calls, and
    whether the server was taken down since the link was made."""

    def __init__(self, client: InferenceClient, server: _Server) -> None:
        self._client = client
        self._server = server
        self._epoch = server.epoch

    async def call(self, path: str, body: dict[str, Any] | None, accept_4xx: bool = False) -> Any:
        return await self._client._call_on(self._server, path, body, accept_4xx)

    async def post_once(self, path: str, body: dict[str, Any]) -> Any:
        return await self._client._attempt(self._server, "POST", path, body, accept_4xx=True)

    def went_down(self) -> bool:
        return self._server.epoch != self._epoch


def _failure(answer: Any) -> str:
    """Why a one-attempt control call failed: its exception, or its answer's message."""
    if isinstance(answer, NoAnswer):
        return answer.reason
    if isinstance(answer, BaseException):
        return f"{type(answer).__name__}: {answer}"
    return error_message(answer)


def _reason(exc: BaseException, timeout_s: float) -> str:
    """A short human description of a transport failure."""
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within {timeout_s:g}s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if exc.os_error.errno == errno.ECONNREFUSED:
            return "connection refused"
        return f"cannot connect: {exc.os_error.strerror or exc.os_error}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the connection was closed before an answer"
    return f"{type(exc).__name__}: {exc}"


class GenerationGate:
    """Where /generate calls wait while a colocated run's servers have given their memory
    to the trainer (areal_cli.rollout.phases): `hold` lets no new call through and
    returns once the calls in flight have ended; `open` lets them go on. Always open
    outside colocated runs."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        while not self._open.is_set():
            await self._open.wait()
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def hold(self) -> None:
        self._open.clear()
        await self._idle.wait()

    def open(self) -> None:
        self._open.set()

    @property
    def held(self) -> bool:
        return not self._open.is_set()


@dataclass
class _Adapters:
    """The LoRA adapters of a backend whose requests name theirs (backends.base:
    `adapters_by_request`): the (name, version) new requests name, and the names loaded
    on the servers, oldest first."""

    current: tuple[str, str] | None = None
    loaded: list[str] = field(default_factory=list)


class InferenceClient:
    """Async client over one or more servers; use `async with` or call `close()`."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        api_key: str = "",
        timeout_s: float = 600.0,
        retries: int = 3,
        policy: Policy = "least_loaded",
        logs: Mapping[str, str] | None = None,
        backoff_s: float = 0.5,
        backend: str = "sglang",
        served_model: str = "",
        lora_name: str = "",
    ) -> None:
        if not addresses:
            raise ValueError("give at least one server address")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if retries < 0 or timeout_s <= 0:
            raise ValueError("retries must be >= 0 and timeout_s > 0")
        logs = logs or {}
        self.servers = [
            _Server(a.rstrip("/"), logs.get(a) or logs.get(a.rstrip("/"))) for a in addresses
        ]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.policy = policy
        self.backoff_s = backoff_s
        self.backend = backend_for(backend)  # its routes and weight-update sequence
        self.served_model = served_model  # the identity its servers must show ('' : any)
        self.lora_name = lora_name or "adapter"  # LoRA runs: version K loads as NAME-vK
        self._lora = _Adapters()  # shared with siblings: the servers' adapters are theirs too
        self._turn = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self.reissued = 0  # generate attempts re-issued after their server died
        self.generated_tokens = 0  # output tokens of the answered /generate calls
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self.gate = GenerationGate()  # shared with its siblings

    def sibling(self) -> InferenceClient:
        """A client of the same servers and settings with its own counters and connections
        (evaluation during training: its requests are counted apart from the rollouts')."""
        twin = InferenceClient(
            [s.address for s in self.servers],
            api_key=self.api_key,
            timeout_s=self.timeout_s,
            retries=self.retries,
            policy=self.policy,
            logs={s.address: s.log for s in self.servers if s.log},
            backoff_s=self.backoff_s,
            backend=self.backend.name,
            served_model=self.served_model,
            lora_name=self.lora_name,
        )
        twin._lora = self._lora  # the same servers: the same adapters loaded
        twin.gate = self.gate  # a colocated run holds both clients' requests at once
        return twin

    @property
    def adapter(self) -> tuple[str, str] | None:
        """The LoRA adapter new requests name, as (name, version); None: none loaded yet,
        or a backend that applies adapters to every request."""
        return self._lora.current

    def busy_s(self) -> float:
        """Wall seconds so far during which at least one /generate call was in flight:
        the time the servers were generating, as this client sees it (overlapping calls
        count once). gen_tokens_per_s is generated_tokens over this clock."""
        now = time.monotonic()
        return self._busy_s + (now - self._busy_since if self._in_flight else 0.0)

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool; the client can be used again afterwards."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ API

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        *,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> dict[str, Any]:
        """One /generate request on one server; returns SGLang's response dict."""
        adapter = self._lora.current if self.backend.adapters_by_request else None
        path, body = self.backend.generate_request(
            input_ids, sampling_params, return_logprob, rid, adapter[0] if adapter else None
        )
        async with self.gate.admit():
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += 1
            try:
                answer = self.backend.generate_answer(await self._call_one(path, body))
            finally:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._busy_s += time.monotonic() - self._busy_since
        self.generated_tokens += len(answer.get("output_ids") or ())
        if adapter is not None:  # every token came from the adapter the request named
            n, version = len(answer.get("output_ids") or ()), adapter[1]
            meta = answer.setdefault("meta_info", {})
            meta["weight_version"] = version
            meta["weight_versions"] = [{"version": version, "start": 0, "end": n}]
        return answer

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | int | None = None
    ) -> list[dict[str, Any]]:
        """Load `model_path` on every server; raise `WeightUpdateFailed` naming any server
        that refused it. Returns each server's answer, in address order."""
        version = None if weight_version is None else str(weight_version)
        pairs = await self._on_live(lambda s: self._load_on(s, str(model_path), version))
        answers = [answer for _, answer in pairs]
        refused = [
            f"{server.address}: {error_message(answer)}"
            for server, answer in pairs
            if not accepted(answer)
        ]
        if refused:
            raise WeightUpdateFailed(
                f"{len(refused)} of {len(pairs)} server(s) refused weights from "
                f"{model_path}: " + "; ".join(refused)
            )
        if self.backend.adapters_by_request and is_adapter_folder(model_path):
            name = self._adapter_name(version)
            self._lora.current = (name, version or "0")  # new requests name it from now on
            if name not in self._lora.loaded:
                self._lora.loaded.append(name)
            del self._lora.loaded[:-2]  # _load_on unloaded the older ones
        return answers

    async def load_weights_on(
        self, address: str, model_path: str, weight_version: str | int
    ) -> dict[str, Any]:
        """Load `model_path` on one server (a restarted one, still down) and return its
        /model_info; raise `WeightUpdateFailed` when it refuses."""
        server = self._server(address)
        answer = await self._load_on(server, str(model_path), str(weight_version))
        if not accepted(answer):
            raise WeightUpdateFailed(
                f"server {address} refused weights from {model_path}: {error_message(answer)}"
            )
        info = await self._model_info_on(server)
        if self.backend.adapters_by_request and is_adapter_folder(model_path):
            # requests name the adapter: they get its version, whatever the server's label
            info = {**info, "weight_version": str(weight_version)}
        return info

    async def join_weight_group(self, bodies: Mapping[str, dict[str, Any]]) -> None:
        """Have each server (address -> its /init_weights_update_group body) join the
        weight-update group, all at once (the join is one rendezvous); raise
        `WeightUpdateFailed` naming each server that did not."""
        await self._group_call(
            list(bodies),
            lambda link, address: self.backend.join_weight_group(link, bodies[address]),
            "did not join the weight-update group",
        )

    async def receive_weights(
        self, addresses: Sequence[str], body: dict[str, Any], first: bool
    ) -> list[Any]:
        """Have the servers at `addresses` receive one bucket of a version (all at once:
        each tensor is one broadcast to all of them; `first`: the version's first bucket);
        raise `WeightUpdateFailed` naming each server that failed. Returns their answers,
        in that order."""
        return await self._group_call(
            addresses,
            lambda link, _: self.backend.receive_weights(link, body, first),
            f"failed to receive {len(body.get('names', []))} tensors",
        )

    async def _group_call(
        self,
        addresses: Sequence[str],
        call: Callable[[_Link, str], Awaitable[Any]],
        failure: str,
    ) -> list[Any]:
        """`call` on every server at `addresses` at once (one collective of the group, so
        none is left out and none is retried); every answer, or `WeightUpdateFailed`
        naming each server whose call failed."""
        servers = [self._server(address) for address in addresses]
        calls = [call(_Link(self, s), s.address) for s in servers]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        failed = [
            f"{s.address}: {_failure(answer)}"
            for s, answer in zip(servers, answers, strict=True)
            if not accepted(answer)
        ]
        if failed:
            raise WeightUpdateFailed(
                f"{len(failed)} of {len(servers)} server(s) {failure}: " + "; ".join(failed)
            )
        return list(answers)

    async def _load_on(self, server: _Server, model_path: str, version: str | None) -> Any:
        """The backend's weight update on one server: its answer in
        /update_weights_from_disk's shape, or WENT_DOWN. A LoRA adapter folder loads as
        an adapter (LORA_NAME-vK), which retires the one before the current: requests in
        flight may still name the current one."""
        link = _Link(self, server)
        if not is_adapter_folder(model_path):
            return await self.backend.load_weights(link, model_path, version)
        if self.backend.adapters_by_request and (problem := adapter_problem(model_path)):
            return {"success": False, "message": problem}  # checked here: the server cannot
        name = self._adapter_name(version)
        older = [a for a in self._lora.loaded if a != name]
        retire = older[-2] if len(older) >= 2 else None
        return await self.backend.load_adapter(link, model_path, name, version or "0", retire)

    def _adapter_name(self, version: str | None) -> str:
        return f"{self.lora_name}-v{version or 0}"

    async def _model_info_on(self, server: _Server) -> Any:
        return await self.backend.model_info(_Link(self, server))

    def set_down(self, address: str) -> None:
        """Take a server out of routing while it restarts (see the module docstring)."""
        server = self._server(address)
        server.down = True
        server.epoch += 1

    def set_up(self, address: str) -> None:
        """Route to a restarted server again."""
        self._server(address).down = False

    def _server(self, address: str) -> _Server:
        return next(s for s in self.servers if s.address == address.rstrip("/"))

    def _live(self) -> list[_Server]:
        return [s for s in self.servers if not s.down]

    def any_up(self) -> bool:
        """Whether any server takes requests (not all are restarting)."""
        return bool(self._live())

    async def model_info(self) -> list[dict[str, Any]]:
        """GET /model_info of every server, in address order."""
        return [info for _, info in await self._on_live(self._model_info_on)]

    async def health(self) -> dict[str, bool]:
        """Whether each server answers GET /health with 200 right now (no retries)."""
        results = await asyncio.gather(*(self._healthy(s) for s in self.servers))
        return {s.address: ok for s, ok in zip(self.servers, results, strict=True)}

    async def healthy(self, address: str) -> bool:
        """Whether one server answers GET /health with 200 right now."""
        return await self._healthy(self._server(address))

    async def release_memory(self) -> list[Any]:
        """Colocated: every server gives its weights' and KV cache's memory to the trainer
        (each must be idle: see `gate`)."""
        pairs = await self._on_live(lambda s: self.backend.release_memory(_Link(self, s)))
        return [answer for _, answer in pairs]

    async def release_memory_on(self, address: str) -> Any:
        """Colocated: one server (a restarted one, still down) gives its memory back."""
        return await self.backend.release_memory(_Link(self, self._server(address)))

    async def resume_memory(self, tags: list[str]) -> list[Any]:
        """Colocated: every server takes back the memory of `tags`."""
        pairs = await self._on_live(lambda s: self.backend.resume_memory(_Link(self, s), tags))
        return [answer for _, answer in pairs]

    async def pause_generation(self, mode: str = "abort") -> list[dict[str, Any]]:
        """Pause every server ("abort", "in_place" or "retract", as in SGLang)."""
        return await self._call_all(*self.backend.pause_request(mode))

    async def continue_generation(self) -> list[dict[str, Any]]:
        """Resume every server after `pause_generation`."""
        return await self._call_all(*self.backend.resume_request())

    async def abort_all(self) -> list[dict[str, Any]]:
        """Abort every in-flight request on every server."""
        return await self._call_all(*self.backend.abort_request())

    def activity(self) -> list[tuple[str, dict[str, int], float]]:
        """(address, calls in flight by path, wall time one was last answered) of every
        server: what the controller's watchdog judges a server by."""
        return [
            (s.address, {k: n for k, n in s.pending.items() if n}, s.last_done)
            for s in self.servers
        ]

    async def wait_healthy(
        self,
        timeout_s: float,
        on_poll: Callable[[dict[str, bool]], None] | None = None,
        interval_s: float = 0.5,
    ) -> None:
        """Poll /health on every server until all answer 200, within one overall deadline.

        `on_poll` sees each round's results and may raise to stop early (e.g. when a
        server process has exited)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = await self.health()
            if on_poll is not None:
                on_poll(status)
            down = [s for s in self.servers if not status[s.address]]
            if not down:
                for server in self.servers:
                    await self.check_identity(server.address)
                return
            if time.monotonic() + interval_s > deadline:
                names = ", ".join(s.address for s in down)
                raise ServerUnavailable(
                    f"server(s) {names} not healthy after {timeout_s:g}s{self._log_hint(down)}"
                )
            await asyncio.sleep(interval_s)

    async def check_identity(self, address: str) -> None:
        """Raise `ForeignServer` unless the server at `address` lists `served_model` on
        /v1/models (every backend has the route); nothing to check without one."""
        if not self.served_model:
            return
        server = self._server(address)
        route = self.backend.models_path
        try:
            answer = await self._attempt(server, "GET", route, None, accept_4xx=True)
        except NoAnswer as exc:
            raise self._unavailable(route, {server.address: exc.reason}) from None
        names = self.backend.served_models(answer)
        if self.served_model in names:
            return
        port = server.address.rsplit(":", 1)[-1]
        seen = (
            f"it serves {', '.join(repr(n) for n in names)}"
            if names
            else f"it answered {route} with {error_message(answer)!r}"
        )
        raise ForeignServer(
            f"the server at {server.address} is not this run's ({seen}; this run's serve "
            f"{self.served_model!r}): another process holds port {port}, so this run's "
            f"server could not bind it{self._log_hint([server])}; stop that process or "
            "leave launcher.inference_base_port at 0 (free ports)"
        )

    # ------------------------------------------------------------------ routing

    def _pick(self, tried: set[str]) -> _Server:
        """The next server by policy, preferring ones not yet tried for this request (and
        never one that is down; the caller waits until one is up)."""
        live = self._live()
        fresh = [s for s in live if s.address not in tried] or live
        start = next(self._turn)
        order = [fresh[(start + i) % len(fresh)] for i in range(len(fresh))]
        if self.policy == "round_robin":
            return order[0]
        return min(order, key=lambda s: s.inflight)  # min keeps the first of equals

    async def _call_one(self, path: str, body: dict[str, Any]) -> Any:
        """POST to one server, retrying transport failures, preferably elsewhere."""
        tried: dict[str, str] = {}
        attempt = 0
        while True:
            while not self._live():  # every server is restarting
                await asyncio.sleep(0.05)
            server = self._pick(set(tried))
            epoch = server.epoch
            server.inflight += 1
            try:
                return await self._attempt(server, "POST", path, body)
            except NoAnswer as exc:
                reason = exc.reason
            finally:
                server.inflight -= 1
            if attempt < self.retries:
                await self._backoff(attempt)
            if server.epoch != epoch:  # it died (set_down): re-issue, not a retry
                self.reissued += 1
                continue
            tried[server.address] = reason
            if attempt == self.retries:
                raise self._unavailable(path, tried)
            attempt += 1

    async def _call_all(self, path: str, body: dict[str, Any] | None, **kw: Any) -> list[Any]:
        """The same call on every server that is up (each with its own retries): the
        answers, in address order; see `_on_live`."""
        pairs = await self._on_live(lambda s: self._call_on(s, path, body, **kw))
        return [answer for _, answer in pairs]

    async def _on_live(self, call: Callable[[_Server], Any]) -> list[tuple[_Server, Any]]:
        """`call(server)` on every server that is up, in address order, with each answer;
        a server that goes down meanwhile (WENT_DOWN) is left out. Every call finishes
        before the first error is raised, so no call is left running."""
        live = self._live()
        results = await asyncio.gather(*(call(s) for s in live), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [(s, r) for s, r in zip(live, results, strict=True) if r is not WENT_DOWN]

    async def _call_on(
        self, server: _Server, path: str, body: dict[str, Any] | None, accept_4xx: bool = False
    ) -> Any:
        method = "GET" if body is None else "POST"
        reason = ""
        epoch = server.epoch
        for attempt in range(self.retries + 1):
            try:
                return await self._attempt(server, method, path, body, accept_4xx)
            except NoAnswer as exc:
                reason = exc.reason
            if server.epoch != epoch:  # it died and restarts (see set_down)
                return WENT_DOWN
            if attempt < self.retries:
                await self._backoff(attempt)
        raise self._unavailable(path, {server.address: reason})

    async def _attempt(
        self,
        server: _Server,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        accept_4xx: bool = False,
    ) -> Any:
        """One HTTP exchange: the decoded JSON (or text) body, or raise."""
        url = server.address + path
        server.pending[path] = server.pending.get(path, 0) + 1
        try:
            async with self._http().request(method, url, json=body) as resp:
                payload = await self._payload(resp)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise NoAnswer(_reason(exc, self.timeout_s)) from exc
        finally:
            server.pending[path] -= 1
        server.last_done = time.time()
        if resp.status >= 500:
            raise NoAnswer(f"HTTP {resp.status}: {error_message(payload)}")
        if resp.status >= 400 and not accept_4xx:
            raise RequestRejected(
                f"server {server.address} rejected {path} with HTTP {resp.status}: "
                f"{error_message(payload)}",
                resp.status,
            )
        return payload

    @staticmethod
    async def _payload(resp: aiohttp.ClientResponse) -> Any:
        """The decoded JSON body; plain text when it is not JSON (e.g. /flush_cache)."""
        text = await resp.text()
        try:
            return json.loads(text) if text else None
        except ValueError:
            return text

    async def _healthy(self, server: _Server) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=min(5.0, self.timeout_s))
            url = server.address + self.backend.health_path
            async with self._http().get(url, timeout=timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def _http(self) -> aiohttp.ClientSession:
        """The shared session, created on first use inside the running event loop."""
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                # No pool cap: queueing inside the client would hide load from least_loaded.
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            )
        return self._session

    async def _backoff(self, attempt: int) -> None:
        await asyncio.sleep(min(MAX_BACKOFF_S, self.backoff_s * 2**attempt))

    # ------------------------------------------------------------------ errors

    def _log_hint(self, servers: list[_Server]) -> str:
        logs = [s.log for s in servers if s.log]
        if not logs:
            return "; check the server log" if len(servers) == 1 else "; check the server logs"
        return (
            "; check its log " + logs[0]
            if len(logs) == 1
            else "; check their logs " + ", ".join(logs)
        )

    def _unavailable(self, path: str, failures: dict[str, str]) -> ServerUnavailable:
        servers = [s for s in self.servers if s.address in failures]
        retries = f"after {self.retries} {'retry' if self.retries == 1 else 'retries'}"
        if len(servers) == 1:
            server = servers[0]
            return ServerUnavailable(
                f"server {server.address} is not answering ({failures[server.address]}) "
                f"{retries}{self._log_hint(servers)}"
            )
        detail = ", ".join(f"{s.address} ({failures[s.address]})" for s in servers)
        return ServerUnavailable(
            f"no server answered {path} {retries}: {detail}{self._log_hint(servers)}"
        )
