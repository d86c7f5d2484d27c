"""`areal train recipes/tiny_distill.yaml` through the real CLI with a builtin teacher:
the launcher builds it into RUN/teacher, the trainer rank loads it frozen beside the
student, and every step reports the student's per-token reverse KL to it. (The learning
run, with the demo's trained policy as the teacher, is in the README; the same step on
1, 2 and 3 ranks is tests/gloo/test_trainer.py's.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.e2e.test_train import _assert_no_processes_left

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_builtin_teacher_is_built_loaded_and_scores_every_step(tmp_path: Path) -> None:
    args = [
        sys.executable, "-m", "areal_cli.cli", "train", "recipes/tiny_distill.yaml",
        f"cluster.fileroot={tmp_path}", "total_train_steps=3", "model.path=builtin:tiny",
        "teacher.path=builtin:small", "teacher.rl_loss_weight=1.0", "logging.display=plain",
        f"launcher.trainer_port={free_port()}", f"launcher.inference_base_port={free_port()}",
        "rollout.batch_size=4", "rollout.group_size=2", "eval.freq_steps=0",
    ]  # fmt: skip
    plan = subprocess.run([*args, "--dry-run"], cwd=REPO, capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert "frozen teacher 22.8M" in plan.stdout  # builtin:small, beside the 1.0M student
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "tiny-distill" / "trial0"
    assert json.loads((run_dir / "teacher" / "config.json").read_text())["hidden_size"] == 512
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if r.get("kind") != "eval"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # two random models disagree: a KL of several nats per token, and finite
    assert all(math.isfinite(r["distill_kl"]) and r["distill_kl"] > 1.0 for r in steps)
    _assert_no_processes_left(run_dir)
