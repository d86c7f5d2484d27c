"""The runs scripts/gpu_check.py makes on a GPU (one device, bf16, NCCL), validated here on
a CPU: a GPU is lent for minutes now and then, and a recipe that one GPU refuses (a split
layout that needs two) must not cost that time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import REPO, areal_in_process


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUNS = sorted(_gpu_check().recipe_runs(Path("/tmp/unused"), "cuda"))


@pytest.mark.parametrize("name", RUNS)
def test_every_gpu_run_of_the_check_is_a_valid_recipe(name: str, tmp_path: Path) -> None:
    args = _gpu_check().recipe_runs(tmp_path, "cuda")[name]
    assert "cluster.n_gpus_per_node=1" in args
    done = areal_in_process("validate", *args)
    assert done.returncode == 0, done.stderr
