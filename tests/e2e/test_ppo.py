"""`areal train recipes/tiny_ppo.yaml` (algorithm: ppo) end to end through the real CLI: the
critic's metrics reach metrics.jsonl, its checkpoint is an HF sequence-classification
folder, and `convert-checkpoint --part critic` finds its config through the run's
config.yaml. The step itself (1 = 2 = 3 ranks, exact resume) is in tests/gloo/test_critic.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from areal_cli.rundir import handoff
from tests.conftest import REPO, free_port, run_areal
from tests.e2e.test_train import _assert_no_processes_left

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_ppo_runs_with_its_critic(tmp_path: Path) -> None:
    import subprocess

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_cli.cli",
            "train",
            "recipes/tiny_ppo.yaml",
            f"cluster.fileroot={tmp_path}",
            "total_train_steps=3",
            "logging.display=plain",
            f"launcher.inference_base_port={free_port()}",
            f"launcher.trainer_port={free_port()}",
            "rollout.batch_size=4",
            "rollout.group_size=2",
            "recover.freq_steps=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "tiny-ppo" / "trial0"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"value_loss", "explained_variance", "value_mean", "critic_grad_norm"} <= set(r)
    assert rows[0]["value_mean"] == 0.0  # the critic's head starts at zero
    assert rows[-1]["value_mean"] != 0.0  # and learns
    config = json.loads((run_dir / "checkpoints" / "critic" / "step-3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    entry = handoff.latest(run_dir / "recover", "step-")
    converted = run_areal(
        "convert-checkpoint",
        str(entry.path),
        str(tmp_path / "critic"),
        "--part",
        "critic",
        "--verify",
    )
    assert converted.returncode == 0, converted.stderr
    assert "max |logit difference| = 0" in converted.stdout
    _assert_no_processes_left(run_dir)
