"""Hub model ids resolve, offline, to the snapshot that the local Hugging Face cache's
refs/main points to; every process gets that folder. An uncached id is refused up front."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli.launch import builtins
from tests.conftest import REPO, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO_ID = "areal-test/tiny-arith"
MAIN = "3f5e0c6d1a2b4c8e9f0a1b2c3d4e5f6a7b8c9d0e"
OLDER = "ffffffffffffffffffffffffffffffffffffffff"  # sorts last, but refs/main is not it


def _hub_cache(tmp_path: Path) -> tuple[Path, Path]:
    """HF_HOME with the tiny demo model laid out as the Hub cache stores it."""
    model = builtins.materialize("tiny-arith", 1, tmp_path / "built")
    hf_home = tmp_path / "hf"
    repo = hf_home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / MAIN
    shutil.copytree(model, snapshot)
    (repo / "snapshots" / OLDER).mkdir()
    (repo / "snapshots" / OLDER / "config.json").write_text("{broken")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    return hf_home, snapshot


def _areal(*args: str, hf_home: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "areal_cli.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_cached_hub_id_trains_from_its_snapshot(tmp_path: Path) -> None:
    hf_home, snapshot = _hub_cache(tmp_path)
    result = _areal(
        "train",
        "recipes/tiny_cpu.yaml",
        f"model.path={REPO_ID}",
        f"cluster.fileroot={tmp_path / 'runs'}",
        "total_train_steps=2",
        "rollout.batch_size=4",
        "rollout.group_size=2",
        "logging.display=plain",
        f"launcher.inference_base_port={free_port()}",
        f"launcher.trainer_port={free_port()}",
        hf_home=hf_home,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"model.path: {REPO_ID} -> {snapshot}" in result.stderr
    run_dir = tmp_path / "runs" / "tiny-cpu" / "trial0"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert f"path: {snapshot}" in (run_dir / "config.yaml").read_text()
    plan = json.loads((run_dir / "plan.json").read_text())
    server = next(p for p in plan["processes"] if p["name"] == "server-0")
    assert server["argv"][server["argv"].index("--model-path") + 1] == str(snapshot)


def test_an_uncached_hub_id_is_a_warning_in_validate_and_an_error_in_train(
    tmp_path: Path,
) -> None:
    hf_home = tmp_path / "empty-hf"
    hf_home.mkdir()
    fileroot = tmp_path / "runs"
    checked = _areal(
        "validate", "recipes/gsm8k_grpo.yaml", f"cluster.fileroot={fileroot}", hf_home=hf_home
    )
    assert checked.returncode == 0, checked.stderr
    assert "warning:" in checked.stderr
    assert "hf download Qwen/Qwen2.5-1.5B-Instruct" in checked.stderr
    planned = _areal(
        "train", "recipes/gsm8k_grpo.yaml", "--dry-run", f"cluster.fileroot={fileroot}",
        hf_home=hf_home,
    )  # fmt: skip
    assert planned.returncode == 0 and "hf download Qwen/Qwen2.5-1.5B-Instruct" in planned.stderr
    refused = _areal(
        "train",
        "recipes/tiny_cpu.yaml",
        "model.path=nobody/not-cached",
        f"cluster.fileroot={fileroot}",
        hf_home=hf_home,
    )
    assert refused.returncode == 2, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, refused.stderr
    assert "model.path" in errors[0] and "hf download nobody/not-cached" in errors[0]
    assert "Traceback" not in refused.stderr
    assert not fileroot.exists()  # nothing started, nothing written
