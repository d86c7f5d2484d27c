"""What an inference backend needs beyond the allocation: vLLM's interpreter."""

from __future__ import annotations

import sys

from areal_cli.config.checker import Checker


def check_vllm(c: Checker, launch: bool) -> None:
    """vLLM runs in the interpreter inference.vllm.python names (or this one), which must
    find the vllm package: an error before a launch, a warning for a plan (a GPU recipe
    is planned on a laptop without vLLM, as with SGLang)."""
    from areal_cli.config.backends import backend_missing, vllm_python

    missing = backend_missing("vllm", vllm_python(c.cfg, sys.executable))
    if missing:
        (c.error if launch else c.warn)("inference.vllm.python", missing)
    launcher = c.cfg.launcher
    if launcher.type == "slurm" or (launcher.type == "ray" and launcher.ray.address):
        c.warn(
            "allocation_mode",
            "vLLM's weight-update routes (/collective_rpc, /update_weight_version) are not "
            "behind --api-key, and on a cluster its servers listen on every interface",
            "run it only on a network that only you reach",
        )
