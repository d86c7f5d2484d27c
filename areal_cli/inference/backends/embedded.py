"""The embedded server (`python -m areal_cli.inference.server`): torch, CPU or GPU.

It speaks SGLang's native API (`SGLangRoutes`) and takes a subset of SGLang's flags
(`embedded_args`), plus its own: in a run it reads each new RUN/weights/vN ahead
(--watch-weights); under `areal serve` it loads weights over HTTP only from the folders
named by --weight-root, and --insecure-no-api-key lets it listen beyond the loopback
without a key. It runs in areal's own interpreter, on one device.

Its API key travels in the environment (API_KEY_ENV), never in argv: a command line is
world-readable in /proc, a process's environment only to its user.
"""

from __future__ import annotations

from typing import ClassVar

from areal_cli.config.schema import ExperimentConfig, ParallelStrategy
from areal_cli.inference.backends.base import ServeOptions, ServerSpec, given
from areal_cli.inference.backends.sglang import SGLangRoutes, where

API_KEY_ENV = "AREAL_API_KEY"


class Embedded(SGLangRoutes):
    name: ClassVar[str] = "embedded"
    module: ClassVar[str] = "areal_cli.inference.server"
    serves_adapter_folders: ClassVar[bool] = True  # merged into its weights on load

    def run_args(
        self, cfg: ExperimentConfig, strategy: ParallelStrategy, spec: ServerSpec
    ) -> list[str]:
        args = embedded_args(
            cfg,
            spec.model,
            spec.port,
            spec.index,
            spec.device_type,
            host=spec.host,
            served_name=spec.served_name,
        )
        # read each new weights/vN ahead, while the controller gets to its update call
        args += ["--watch-weights", spec.weights_dir]
        if cfg.actor.weight_update.distributed:  # the group's join and receives wait this long
            args += ["--dist-timeout", f"{cfg.trainer.collective_timeout_s:g}"]
        return args

    def run_env(self, cfg: ExperimentConfig, spec: ServerSpec) -> dict[str, str]:
        return self.serve_env(cfg.inference.api_key)

    def serve_args(self, cfg: ExperimentConfig, opts: ServeOptions) -> list[str]:
        if opts.tp != 1:
            raise ValueError("the embedded backend runs on one device; use --tp 1")
        # "auto" lets the server pick CUDA when present, without importing torch here.
        args = embedded_args(
            cfg, opts.model, opts.port, 0, "auto", host=opts.host,
            weight_version=opts.weight_version,
        )  # fmt: skip
        for root in opts.weight_roots:
            args += ["--weight-root", root]
        if opts.insecure_no_api_key:
            args.append("--insecure-no-api-key")
        return args

    def serve_env(self, api_key: str) -> dict[str, str]:
        return {API_KEY_ENV: api_key} if api_key else {}

    def serve_flag_problem(self, weight_roots: bool, insecure_no_api_key: bool) -> str:
        return ""  # both are its own flags


def embedded_args(
    cfg: ExperimentConfig,
    model: str,
    port: int,
    index: int,
    device_type: str,
    *,
    host: str = "127.0.0.1",
    served_name: str | None = None,
    weight_version: str = "0",
) -> list[str]:
    """Flags of the embedded server (areal_cli.inference.server); a subset of SGLang's."""
    e = cfg.inference.embedded
    device = e.device if e.device != "auto" else device_type
    args = [
        *where(model, host, port),
        "--dtype",
        e.dtype,
        "--weight-version",
        weight_version,
        "--max-running-requests",
        str(e.max_running_requests),
        "--random-seed",
        str(cfg.seed + index),
        "--device",
        device,
    ]
    args += given(
        {
            "--served-model-name": served_name,
            "--context-length": e.context_length,
            "--cuda-graph-max-bs-decode": e.cuda_graph_max_bs,
        }
    )
    if e.disable_cuda_graph:
        args.append("--disable-decode-cuda-graph")
    return args  # the key travels in the environment (Embedded.run_env)
