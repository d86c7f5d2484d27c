"""Command lines of the inference servers: SGLang's and the embedded server's.

`sglang_args` names every flag as SGLang's server_args.py does (a test checks them against
the flags of a real SGLang release); `embedded_args` gives the embedded server the subset
it implements. The launch plan and `areal serve` both build their command lines here, so a
training run and `areal serve` start servers identically. Standard library and config only:
`areal serve` must start fast.
"""

from __future__ import annotations

import sys

from areal_cli.config.allocation import AllocationMode, parse_allocation
from areal_cli.config.schema import DTYPES, ExperimentConfig

BACKENDS = ("embedded", "sglang")
# The embedded server reads its API key from this variable, never from argv: a command
# line is world-readable in /proc, a process's environment only to its user. SGLang takes
# its key as --api-key only, so there it stays in argv (redacted in plans and logs).
API_KEY_ENV = "AREAL_API_KEY"


def server_env(backend: str, api_key: str) -> dict[str, str]:
    """The environment that carries a server's API key (the embedded backend's)."""
    return {API_KEY_ENV: api_key} if api_key and backend == "embedded" else {}


SGLANG_MISSING = "sglang is not installed; install with pip install -e '.[sglang]' on a GPU machine"


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
    dtypes = DTYPES + ("auto",) if backend == "sglang" else DTYPES
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


def sglang_args(
    cfg: ExperimentConfig,
    mode: AllocationMode,
    model: str,
    port: int,
    index: int,
    *,
    host: str = "127.0.0.1",
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
    optional = {
        "--context-length": s.context_length,
        "--max-running-requests": s.max_running_requests,
        "--chunked-prefill-size": s.chunked_prefill_size,
        "--attention-backend": s.attention_backend,
        "--tokenizer-path": cfg.model.tokenizer_path or None,
        "--api-key": cfg.inference.api_key or None,
    }
    for flag, value in optional.items():
        if value is not None:
            args += [flag, str(value)]
    switches = {
        "--disable-radix-cache": s.disable_radix_cache,
        "--enable-deterministic-inference": s.enable_deterministic_inference,
        "--enable-metrics": s.enable_metrics,
        "--skip-server-warmup": s.skip_server_warmup,
        "--trust-remote-code": s.trust_remote_code,
    }
    return args + [flag for flag, on in switches.items() if on]


def embedded_args(
    cfg: ExperimentConfig,
    model: str,
    port: int,
    index: int,
    device_type: str,
    *,
    host: str = "127.0.0.1",
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
    return args  # the key travels in the environment (server_env)
