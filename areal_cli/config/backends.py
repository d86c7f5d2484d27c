"""Where an inference backend's server runs, and whether it can: the interpreter of vLLM's
server and the package lookups behind the one-line errors of `areal train` and `areal
serve`. Standard library only; the packages are looked up, not imported (vLLM's import
takes ~5 s)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from areal_cli.config.schema import ExperimentConfig

SGLANG_MISSING = "sglang is not installed; install with pip install -e '.[sglang]' on a GPU machine"
VLLM_MISSING = (
    "cannot import vllm with {python}; run make vllm (its own venv, .venv-vllm) and use "
    ".venv-vllm/bin/python (recipes: inference.vllm.python; areal serve: --python), or "
    "pip install -e '.[vllm]' on a GPU machine"
)


def vllm_python(cfg: ExperimentConfig, python: str) -> str:
    """The interpreter of vLLM's server: inference.vllm.python (made absolute from the
    working directory, keeping a venv's symlink), else `python`, the run's own."""
    chosen = cfg.inference.vllm.python
    return str(Path(chosen).absolute()) if chosen else python


def backend_missing(backend: str, python: str) -> str:
    """Why `python` cannot run BACKEND's server ('' when it can)."""
    if backend not in ("sglang", "vllm"):  # the embedded server runs in areal's own venv
        return ""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({backend!r}) is None)"
    try:
        if subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0:
            return ""
    except OSError:  # no such interpreter
        pass
    return SGLANG_MISSING if backend == "sglang" else VLLM_MISSING.format(python=python)
