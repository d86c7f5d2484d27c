"""The inference backends, one module each, and the registry: name -> backend object.

A backend (base.InferenceBackend) owns its server's interpreter, command line and
environment, its readiness check, its route mapping and its weight-update sequence. The
client, the launch plan and `areal serve` look a backend up here by its name in
allocation_mode (or --backend) and ask it; adding a backend is a module of this package
and one line below (and its name in config.allocation.INFERENCE_BACKENDS, which parses
allocation_mode).
"""

from __future__ import annotations

from areal_cli.inference.backends.base import InferenceBackend, ServeOptions, ServerSpec
from areal_cli.inference.backends.embedded import Embedded
from areal_cli.inference.backends.sglang import SGLang
from areal_cli.inference.backends.vllm import VLLM

BACKENDS: dict[str, InferenceBackend] = {
    backend.name: backend for backend in (Embedded(), SGLang(), VLLM())
}

__all__ = ["BACKENDS", "InferenceBackend", "ServeOptions", "ServerSpec", "backend_for"]


def backend_for(name: str) -> InferenceBackend:
    """The backend called NAME; raises ValueError naming the known ones."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return BACKENDS[name]
