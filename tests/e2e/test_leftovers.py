"""What areal writes outside the run directory: only AREAL_CACHE_DIR. Nothing goes under
the home directory, and nothing is left in the temp directory (torchrun's log folders
included)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli.launch import builtins
from tests.conftest import REPO, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_train_and_eval_write_only_the_run_and_the_cache(tmp_path: Path) -> None:
    home, cache, tmp, runs = (tmp_path / d for d in ("home", "cache", "tmp", "runs"))
    for folder in (home, cache / "models", tmp):
        folder.mkdir(parents=True)
    built = builtins.cached("tiny-arith", 1)  # reuse the build: only the place matters
    shutil.copytree(built, cache / "models" / built.name)
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "XDG_CACHE_HOME", "MPLCONFIGDIR")
    }
    env.update(HOME=str(home), AREAL_CACHE_DIR=str(cache), TMPDIR=str(tmp), COLUMNS="200")
    common = [
        f"cluster.fileroot={runs}", f"launcher.inference_base_port={free_port()}",
        f"launcher.trainer_port={free_port()}",
    ]  # fmt: skip
    commands = [
        ["train", "recipes/tiny_cpu.yaml", *common, "total_train_steps=2", "logging.display=plain",
         "rollout.batch_size=4", "rollout.group_size=2"],
        ["eval", "recipes/tiny_cpu.yaml", *common, "eval.max_prompts=4", "eval.n_samples=1",
         "eval.k=[1]", "--checkpoint", str(runs / "tiny-cpu" / "trial0")],
    ]  # fmt: skip
    for args in commands:
        result = subprocess.run(
            [sys.executable, "-m", "areal_cli.cli", *args],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert _tree(home) == [], "written under the home directory"
    assert _tree(tmp) == [], "left in the temp directory"
    # JSONL is read directly: no Arrow copy anywhere (Parquet's would go to cache/datasets)
    assert not (cache / "datasets").exists()
