"""`areal train recipes/tiny_dpo.yaml` (algorithm: dpo) end to end through the real CLI:
the policy and its frozen reference on one, two and tensor-parallel ranks take the same
steps, and the held-out preference accuracy rises.

Uneven on purpose: 13 pairs per step over 2 ranks, micro-batches of about two pairs, so
ranks hold different numbers of pairs and micro-batches. Plain SGD in the layout runs:
the weights after a step are then linear in its gradient, so they compare at 1e-5 (Adam's
first steps divide near-zero gradients by their own size, which turns the all-reduces'
rounding into differences of the learning rate's size; tests/e2e/test_sft.py says more).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.e2e.test_train import _assert_no_processes_left
from tests.gloo.test_trainer import _load_all, _max_diff

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 4


def _run(fileroot: Path, layout: str, *extra: str) -> Path:
    args = [
        sys.executable, "-m", "areal_cli.cli", "train", "recipes/tiny_dpo.yaml",
        f"cluster.fileroot={fileroot}", f"total_train_steps={STEPS}",
        f"allocation_mode=fsdp:{layout}", "logging.display=plain",
        f"launcher.trainer_port={free_port()}", "dpo.batch_size=13", "dpo.eval_freq_steps=2",
        "actor.mb_spec.max_tokens_per_mb=64", "actor.optimizer.type=sgd",
        "actor.optimizer.lr=0.1", "actor.optimizer.warmup_steps_proportion=0", *extra,
    ]  # fmt: skip
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return fileroot / "tiny-dpo" / "trial0"


def _rows(run_dir: Path) -> list[dict]:
    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_takes_the_same_steps_on_one_two_and_tensor_parallel_ranks(
    tmp_path: Path, loss_type: str
) -> None:
    layouts = ("d1", "d2", "d1t2") if loss_type == "sigmoid" else ("d1", "d2")
    runs = {k: _run(tmp_path / k, k, f"actor.loss_type={loss_type}") for k in layouts}
    one = _rows(runs["d1"])
    assert [r["step"] for r in one] == list(range(1, STEPS + 1))
    assert one[0]["accuracy"] == 0.0  # the policy is the reference: every margin is 0
    assert one[0]["eval_accuracy_initial"] == 0.0
    assert one[-1]["eval_margin"] > 0 and one[-1]["eval_loss"] < one[0]["eval_loss_initial"]
    assert all(r["pairs"] == 13 for r in one)
    final = {k: _load_all(r / "checkpoints" / f"step-{STEPS}") for k, r in runs.items()}
    assert "lm_head.weight" in final["d1"]  # a causal LM, not a scalar head
    for layout in layouts[1:]:
        other = _rows(runs[layout])
        for a, b in zip(one, other, strict=True):
            for key in ("loss", "margin", "chosen_reward", "eval_loss", "eval_margin"):
                if key in a:
                    assert a[key] == pytest.approx(b[key], abs=1e-5), (layout, key)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), layout
        assert _max_diff(final["d1"], final[layout]) < 1e-5, layout
    for run_dir in runs.values():
        _assert_no_processes_left(run_dir)
