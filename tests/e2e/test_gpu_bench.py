"""scripts/gpu_bench.py --cpu: the engine's and the trainer's GPU benchmark (issues 44,
45) on a tiny model on the CPU, so that it is known to run the moment a GPU machine is
lent, and the engine's exactness checks (logprobs against transformers, greedy against
model.generate, a seeded request alone and in a batch of 64) hold on the CPU in CI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_gpu_bench_runs_on_the_cpu_and_its_exactness_checks_pass() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/gpu_bench.py", "--cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    table = done.stdout[done.stdout.find("gpu_bench (--cpu)") :]
    for row in ("engine 16x32", "model.generate, same batch", "engine / generate",
                "batch 1 decode step", "profile, decode at batch", "peak memory",
                "trainer, equal lengths", "plain loop, mixed lengths",
                "trainer / plain loop, mixed"):  # fmt: skip
        assert row in table, table
    exact = [line for line in table.splitlines() if line.startswith("exact: ")]
    assert len(exact) == 3 and all("  PASS  " in line for line in exact), table
    assert "aten ops per step" in table and "parameters" in table
    assert "static steps run eagerly" in table  # the CUDA-graph path's CPU rehearsal
