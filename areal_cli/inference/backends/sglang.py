"""SGLang: `python -m sglang.launch_server`, and SGLang's native HTTP API.

`sglang_args` names every flag as SGLang's server_args.py does (a test checks them against
the flags of a real SGLang release). `SGLangRoutes` is the native API the client speaks:
the embedded server answers the same routes, so its backend shares them.

SGLang takes its API key as --api-key only, so there it stays in argv (redacted in plans
and logs). It runs in the run's own interpreter, on GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from areal_cli.config.schema import DTYPES, ExperimentConfig, ParallelStrategy
from areal_cli.inference.backends.base import (
    WENT_DOWN,
    InferenceBackend,
    Link,
    Route,
    ServeOptions,
    ServerSpec,
    accepted,
    given,
    importable,
)

SGLANG_MISSING = "sglang is not installed; install with pip install -e '.[sglang]' on a GPU machine"


def where(model: str, host: str, port: int) -> list[str]:
    """The flags SGLang and the embedded server share: what to serve and where to listen."""
    return ["--model-path", model, "--host", host, "--port", str(port)]


class SGLangRoutes(InferenceBackend):
    """SGLang's native API (the subset DESIGN §6 names), which the embedded server speaks
    too: the client's calls are the routes themselves, and answers need no mapping."""

    def generate_request(
        self,
        input_ids: list[int],
        params: Mapping[str, Any],
        return_logprob: bool,
        rid: str | None,
        adapter: str | None = None,
    ) -> Route:
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(params),
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        if adapter is not None:
            body["lora_path"] = adapter  # GenerateReqInput: a loaded adapter's name
        return "/generate", body

    def pause_request(self, mode: str) -> Route:
        return "/pause_generation", {"mode": mode}

    def resume_request(self) -> Route:
        return "/continue_generation", {}

    def abort_request(self) -> Route:
        return "/abort_request", {"abort_all": True}

    async def model_info(self, link: Link) -> Any:
        return await link.call("/model_info", None)

    distributed_updates: ClassVar[bool] = True

    async def join_weight_group(self, link: Link, body: dict[str, Any]) -> Any:
        return await link.post_once("/init_weights_update_group", body)

    async def receive_weights(self, link: Link, body: dict[str, Any], first: bool) -> Any:
        return await link.post_once("/update_weights_from_distributed", body)

    async def load_weights(self, link: Link, model_path: str, version: str | None) -> Any:
        """One call, /update_weights_from_disk; a 4xx refusal is an answer, not an error."""
        body = {"model_path": model_path}
        if version is not None:
            body["weight_version"] = version
        return await link.call("/update_weights_from_disk", body, accept_4xx=True)


class SGLang(SGLangRoutes):
    name: ClassVar[str] = "sglang"
    module: ClassVar[str] = "sglang.launch_server"
    dtypes: ClassVar[tuple[str, ...]] = (*DTYPES, "auto")

    def missing(self, python: str) -> str:
        return "" if importable(python, "sglang") else SGLANG_MISSING

    def run_args(
        self, cfg: ExperimentConfig, strategy: ParallelStrategy, spec: ServerSpec
    ) -> list[str]:
        args = sglang_args(
            cfg,
            strategy,
            spec.model,
            spec.port,
            spec.index,
            host=spec.host,
            served_name=spec.served_name,
        )
        args += self.lora_args(cfg)
        # colocated: /release_memory_occupation frees the weights and the KV cache only
        # with SGLang's torch_memory_saver armed
        return [*args, "--enable-memory-saver"] if spec.shared else args

    adapters_by_request: ClassVar[bool] = True

    def lora_args(self, cfg: ExperimentConfig) -> list[str]:
        """SGLang's LoRA flags: adapters up to the actor's rank on its target modules
        (`all` for all-linear); two adapters loaded at once, the newest version and the
        one requests still in flight may name."""
        a = cfg.actor
        if not a.use_lora:
            return []
        targets = ["all"] if list(a.target_modules) == ["all-linear"] else list(a.target_modules)
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(a.lora_rank),
            "--lora-target-modules",
            *targets,
            "--max-loras-per-batch",
            "2",
        ]

    async def load_adapter(
        self, link: Link, folder: str, name: str, version: str, retire: str | None
    ) -> Any:
        """/load_lora_adapter (LoadLoRAAdapterReqInput), then /unload_lora_adapter of
        `retire`. No /update_weight_version: a request keeps the adapter it named from its
        first token to its last, so its tokens carry that adapter's version (the client
        labels them), whatever the server has loaded since."""
        answer = await link.call(
            "/load_lora_adapter", {"lora_name": name, "lora_path": folder}, accept_4xx=True
        )
        if answer is WENT_DOWN or not accepted(answer):
            return answer
        if retire is not None:
            await link.call("/unload_lora_adapter", {"lora_name": retire}, accept_4xx=True)
        # the version new requests get: those that name this adapter
        return {"success": True, "message": f"loaded adapter {name}", "weight_version": version}

    def serve_args(self, cfg: ExperimentConfig, opts: ServeOptions) -> list[str]:
        strategy = ParallelStrategy(tensor_parallel_size=opts.tp)
        return sglang_args(
            cfg, strategy, opts.model, opts.port, 0, host=opts.host,
            weight_version=opts.weight_version,
        )  # fmt: skip


def sglang_args(
    cfg: ExperimentConfig,
    strategy: ParallelStrategy,
    model: str,
    port: int,
    index: int,
    *,
    host: str = "127.0.0.1",
    served_name: str | None = None,
    weight_version: str = "0",
) -> list[str]:
    """Flags for `python -m sglang.launch_server`, named as in SGLang's server_args.py."""
    s = cfg.inference.sglang
    args = [
        *where(model, host, port),
        "--tp-size",
        str(strategy.tensor_parallel_size),
        "--pp-size",
        str(strategy.pipeline_parallel_size),
        "--base-gpu-id",
        "0",
        "--dtype",
        s.dtype,
        "--mem-fraction-static",
        str(s.mem_fraction_static),
        "--random-seed",
        str(s.random_seed if s.random_seed is not None else cfg.seed + index),
        "--schedule-policy",
        s.schedule_policy,
        "--log-level",
        s.log_level,
        "--weight-version",
        weight_version,
    ]
    args += given(
        {
            "--context-length": s.context_length,
            "--max-running-requests": s.max_running_requests,
            "--chunked-prefill-size": s.chunked_prefill_size,
            "--attention-backend": s.attention_backend,
            "--cuda-graph-max-bs-decode": s.cuda_graph_max_bs,
            "--tokenizer-path": cfg.model.tokenizer_path or None,
            "--served-model-name": served_name,
            "--api-key": cfg.inference.api_key or None,
            # the weight-update group's join waits this long (method distributed)
            "--dist-timeout": int(cfg.trainer.collective_timeout_s)
            if cfg.actor.weight_update.distributed
            else None,
        }
    )
    switches = {
        "--disable-radix-cache": s.disable_radix_cache,
        "--disable-decode-cuda-graph": s.disable_cuda_graph,
        "--enable-deterministic-inference": s.enable_deterministic_inference,
        "--enable-metrics": s.enable_metrics,
        "--skip-server-warmup": s.skip_server_warmup,
        "--trust-remote-code": s.trust_remote_code,
    }
    return args + [flag for flag, on in switches.items() if on]
