"""What an inference backend is (`InferenceBackend`), and the pieces the backends share.

A backend is one module of this package holding one object, which owns everything that
differs between servers: where its server runs (the interpreter, and why it cannot run
there), its command line and environment, how the client knows a server is ready and is
the run's own, how the client's calls map onto its HTTP routes, and its weight-update
sequence. The client (`inference.client`), the launch plan and `areal serve` ask this
object and never branch on a backend's name; adding a backend is one module here and one
line in the registry (`backends/__init__.py`).

The client keeps the transport (connections, retries, routing, restarts). A backend
reaches one server through a `Link` the client gives it, so a multi-call sequence (vLLM's
weight update) lives in the backend's module while every HTTP exchange stays the client's.

Standard library, config and the weight group's wire protocol (no torch at import):
`areal serve` must start fast.
"""

from __future__ import annotations

import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

from areal_cli.config.checker import Checker
from areal_cli.config.schema import DTYPES, ExperimentConfig, InferenceConfig, ParallelStrategy
from areal_cli.rundir.weight_group import TORCH_GROUP

Route = tuple[str, dict[str, Any]]  # (path, JSON body) of one POST

# What a call returns for a server that was taken down (set_down) while it ran: the
# server is restarting, and its answer is left out instead of failing the call.
WENT_DOWN: Any = object()


class NoAnswer(Exception):
    """One failed attempt (connection error, timeout, HTTP 5xx) that may succeed on a
    retry; `reason` is for the final message."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Link(Protocol):
    """One server, as the client lets a backend reach it during a control sequence."""

    async def call(self, path: str, body: dict[str, Any] | None, accept_4xx: bool = False) -> Any:
        """GET (body None) or POST with the client's retries: the decoded answer, or
        WENT_DOWN when the server was taken down meanwhile. Raises the client's
        ServerUnavailable when the retries run out, RequestRejected on HTTP 4xx unless
        `accept_4xx`."""
        ...

    async def post_once(self, path: str, body: dict[str, Any]) -> Any:
        """One POST, no retry, an HTTP 4xx answer returned; raises NoAnswer."""
        ...

    def went_down(self) -> bool:
        """Whether the server was taken down since this link was made."""
        ...


@dataclass(frozen=True)
class ServerSpec:
    """One server of a run, as the launch plan places it."""

    model: str  # the folder it serves first
    port: int
    index: int  # its place among the run's servers: each gets its own seed
    host: str  # where it listens
    device_type: str  # "cuda" or "cpu"
    served_name: str | None  # the run's identity on /v1/models (launch.plan.served_name)
    cpus: tuple[int, ...] = ()  # the cores it is pinned to, off CUDA
    weights_dir: str = ""  # RUN/weights, where the run publishes new weights
    shared: bool = False  # colocated ('|'): it releases its memory while the trainer steps


@dataclass(frozen=True)
class ServeOptions:
    """The flags of `areal serve`: one server, outside a run."""

    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str = ""
    dtype: str | None = None  # None: the backend's default
    tp: int = 1
    weight_roots: tuple[str, ...] = ()  # folders it may load weights from (embedded)
    insecure_no_api_key: bool = False  # listen beyond loopback without a key (embedded)
    max_running_requests: int | None = None  # None: the backend's default
    context_length: int | None = None  # None: the model's
    weight_version: str = "0"  # the label it serves under (a run's vN: "N")


def accepted(answer: Any) -> bool:
    """Whether a server's answer to a weight update says it loaded them."""
    return isinstance(answer, dict) and bool(answer.get("success"))


def error_message(body: Any) -> str:
    """The message of an error body in SGLang's or OpenAI's shape, else the raw body."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "error_message"):  # SGLang's LoRA answers: error_message
            if body.get(key):
                return str(body[key])
    return str(body)[:500]


def given(flags: dict[str, object]) -> list[str]:
    """`--flag value` for each flag whose value is set (not None)."""
    return [
        item for flag, value in flags.items() if value is not None for item in (flag, str(value))
    ]


def importable(python: str, package: str) -> bool:
    """Whether `python` finds `package`; looked up, not imported (vLLM's import takes ~5 s)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"
    try:
        return (
            subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
        )
    except OSError:  # no such interpreter
        return False


class InferenceBackend(ABC):
    """One inference backend: how its server starts and how the client speaks to it."""

    name: ClassVar[str]  # as in allocation_mode and `areal serve --backend`
    module: ClassVar[str]  # `python -m MODULE` starts its server
    dtypes: ClassVar[tuple[str, ...]] = DTYPES  # what --dtype may be
    # the keys of its config section that `areal serve --max-running-requests` and
    # `--context-length` set (each backend names them as its own server does)
    serve_keys: ClassVar[tuple[str, str]] = ("max_running_requests", "context_length")
    # Readiness: a server is used once HEALTH answers 200 and MODELS lists the run's
    # served name (every backend has both routes; the client's wait_healthy).
    health_path: ClassVar[str] = "/health"
    models_path: ClassVar[str] = "/v1/models"

    # ------------------------------------------------------------ where it runs

    def interpreter(self, cfg: ExperimentConfig, python: str) -> str:
        """The interpreter of a run's server; `python` is the run's own."""
        return python

    def missing(self, python: str) -> str:
        """Why `python` cannot run this backend's server ('' when it can)."""
        return ""

    def check(self, c: Checker, launch: bool) -> None:
        """This backend's rules of a recipe beyond the allocation's (config.rules runs
        them through `check_config(..., backends=backend_for)`); none by default."""
        return None

    # ------------------------------------------------------------ a run's server

    def run_argv(
        self, cfg: ExperimentConfig, strategy: ParallelStrategy, spec: ServerSpec, python: str
    ) -> list[str]:
        """The command line of one server of a run."""
        args = self.run_args(cfg, strategy, spec)
        return [self.interpreter(cfg, python), "-m", self.module, *args]

    @abstractmethod
    def run_args(
        self, cfg: ExperimentConfig, strategy: ParallelStrategy, spec: ServerSpec
    ) -> list[str]:
        """The flags of one server of a run."""

    def run_env(self, cfg: ExperimentConfig, spec: ServerSpec) -> dict[str, str]:
        """What one server of a run reads from its environment, beyond the plan's own."""
        return {}

    # ------------------------------------------------------------ areal serve

    def serve_argv(self, opts: ServeOptions, python: str) -> list[str]:
        """The command line of `areal serve`, from a default config with these settings;
        raises ValueError for a setting this backend does not take."""
        if opts.dtype is not None and opts.dtype not in self.dtypes:
            raise ValueError(
                f"--dtype for {self.name} must be one of {', '.join(self.dtypes)}, "
                f"got {opts.dtype!r}"
            )
        if opts.tp < 1:
            raise ValueError("--tp must be at least 1")
        return [python, "-m", self.module, *self.serve_args(self.serve_config(opts), opts)]

    def serve_config(self, opts: ServeOptions) -> ExperimentConfig:
        """The default config with `areal serve`'s key and dtype (built so, never changed:
        the section of each backend is named as the backend)."""
        inference = InferenceConfig(api_key=opts.api_key)
        given_opts = {
            "dtype": opts.dtype,
            self.serve_keys[0]: opts.max_running_requests,
            self.serve_keys[1]: opts.context_length,
        }
        chosen = {k: v for k, v in given_opts.items() if v is not None}
        if chosen:
            section = replace(getattr(inference, self.name), **chosen)
            inference = replace(inference, **{self.name: section})
        return ExperimentConfig(inference=inference)

    @abstractmethod
    def serve_args(self, cfg: ExperimentConfig, opts: ServeOptions) -> list[str]:
        """The flags of `areal serve`'s server; `cfg` is `serve_config(opts)`."""

    def serve_env(self, api_key: str) -> dict[str, str]:
        """The environment of `areal serve`'s server."""
        return {}

    def serve_flag_problem(self, weight_roots: bool, insecure_no_api_key: bool) -> str:
        """Why `areal serve` cannot take these flags for this backend ('' when it can)."""
        if weight_roots or insecure_no_api_key:
            return "--weight-root and --insecure-no-api-key are flags of the embedded server"
        return ""

    # ------------------------------------------------------------ readiness

    def served_models(self, answer: Any) -> list[str]:
        """The model names in an answer of MODELS (OpenAI's list shape)."""
        cards = answer.get("data") or [] if isinstance(answer, dict) else []
        return [str(card.get("id")) for card in cards if isinstance(card, dict)]

    # ------------------------------------------------------------ routes

    @abstractmethod
    def generate_request(
        self,
        input_ids: list[int],
        params: Mapping[str, Any],
        return_logprob: bool,
        rid: str | None,
        adapter: str | None = None,
    ) -> Route:
        """One generation: token ids and SGLang's sampling params, in this server's words;
        `adapter`: the LoRA adapter to generate with, by the name it was loaded under
        (only for a backend whose `adapters_by_request`)."""

    def generate_answer(self, answer: Any) -> dict[str, Any]:
        """The server's answer to `generate_request` in SGLang's /generate shape."""
        return answer

    @abstractmethod
    def pause_request(self, mode: str) -> Route:
        """Pause generation ("abort", "in_place" or "retract", as in SGLang)."""

    @abstractmethod
    def resume_request(self) -> Route:
        """Resume generation after a pause."""

    @abstractmethod
    def abort_request(self) -> Route:
        """Abort every request in flight."""

    @abstractmethod
    async def model_info(self, link: Link) -> Any:
        """The server's model info in SGLang's /model_info shape (`weight_version`)."""

    # ------------------------------------------------------------ the weight-update group
    # (actor.weight_update.method: distributed; the protocol is rundir.weight_group)

    distributed_updates: ClassVar[bool] = False  # whether it takes the group's routes
    group_protocol: ClassVar[str] = TORCH_GROUP  # how its servers make the group

    async def join_weight_group(self, link: Link, body: dict[str, Any]) -> Any:
        """Join the weight-update group (SGLang's /init_weights_update_group body): the
        answer in SGLang's shape (`success`, `message`). One attempt: the join is a
        rendezvous, which a retry would not repeat but break."""
        raise NotImplementedError(f"{self.name} takes no distributed weight update")

    async def receive_weights(self, link: Link, body: dict[str, Any], first: bool) -> Any:
        """Receive one bucket (SGLang's /update_weights_from_distributed body; `first`: the
        first bucket of a version); one attempt, as for the join."""
        raise NotImplementedError(f"{self.name} takes no distributed weight update")

    # ------------------------------------------------------------ colocation ('|')
    # SGLang's routes (the embedded server's too); vLLM's are its sleep mode's.

    async def release_memory(self, link: Link) -> Any:
        """Give the weights' and the KV cache's memory to the trainer (the server must be
        idle); the answer, or WENT_DOWN."""
        return await link.call("/release_memory_occupation", {"tags": None})

    async def resume_memory(self, link: Link, tags: list[str]) -> Any:
        """Take back the memory of `tags` ("weights" before a weight update, "kv_cache"
        after it); the answer, or WENT_DOWN."""
        return await link.call("/resume_memory_occupation", {"tags": tags})

    # ------------------------------------------------------------ LoRA adapters
    # (actor.use_lora: each version is a PEFT adapter folder)

    # Whether a request names its adapter (SGLang's lora_path, vLLM's model): the server
    # keeps adapters apart, and a request runs with the one it named from start to end.
    # False: the server applies a loaded adapter to every request (the embedded server
    # merges it into its weights), as a full weight update.
    adapters_by_request: ClassVar[bool] = False
    # Whether its server starts from a LoRA adapter folder (on the base model it names);
    # `areal serve` gives the others the adapter merged into its base.
    serves_adapter_folders: ClassVar[bool] = False

    def lora_args(self, cfg: ExperimentConfig) -> list[str]:
        """The flags that let a server of a LoRA run take adapters (none by default)."""
        return []

    async def load_adapter(
        self, link: Link, folder: str, name: str, version: str, retire: str | None
    ) -> Any:
        """Load the adapter folder as `name` (version `version`), and unload `retire`, an
        adapter no request names any more: the answer in /update_weights_from_disk's
        shape, or WENT_DOWN. By default the adapter is a weight update like any other."""
        return await self.load_weights(link, folder, version)

    @abstractmethod
    async def load_weights(self, link: Link, model_path: str, version: str | None) -> Any:
        """Load the HF folder `model_path` and label what follows `version` (None: the
        server's choice): the answer in SGLang's /update_weights_from_disk shape
        (`success`, `message`), or WENT_DOWN."""
