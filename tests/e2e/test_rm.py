"""`areal train recipes/tiny_rm.yaml` (algorithm: rm) end to end through the real CLI: a
scalar head on the model's body, the same loss at every layout, resume after kill -9,
conversion of the reward model both ways, and an RL run that uses it as its reward.

Each run is a few steps on uneven batches (13 pairs over 2 ranks, micro-batches of about
two pairs), so ranks hold different numbers of pairs and micro-batches. The base model is
builtin:tiny (not tiny-arith) so that no SFT run is needed first.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_cli.rundir import handoff
from tests.conftest import REPO, free_port, run_areal
from tests.e2e.test_sft import LAYOUT_ARGS, STEPS, run_layouts
from tests.e2e.test_train import _assert_no_processes_left, _wait_for
from tests.gloo.test_trainer import _load_all, _max_diff

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _args(fileroot: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "areal_cli.cli",
        "train",
        "recipes/tiny_rm.yaml",
        f"cluster.fileroot={fileroot}",
        f"total_train_steps={steps}",
        "model.path=builtin:tiny",
        "logging.display=plain",
        f"launcher.trainer_port={free_port()}",
        "rm.batch_size=13",
        "rm.eval_freq_steps=2",
        "actor.mb_spec.max_tokens_per_mb=64",
        *extra,
    ]


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _run(fileroot: Path, steps: int, *extra: str) -> Path:
    done = subprocess.run(
        _args(fileroot, steps, *extra), cwd=REPO, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return fileroot / "tiny-rm" / "trial0"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # d2 (FSDP alone) is the SFT role's test: the supervised step is shared, and the
    # reward model's own parts (the scalar head, sharded under tp) are d1t2's
    return run_layouts(_run, tmp_path_factory.mktemp("rm-layouts"), ("d1", "d1t2"))


def test_rm_trains_the_same_at_every_layout_and_scores_an_rl_run(
    tmp_path: Path, layouts: dict[str, Path]
) -> None:
    runs = layouts
    one = _rows(runs["d1"])
    assert [r["step"] for r in one] == list(range(1, STEPS + 1))
    assert [r["step"] for r in one if "eval_accuracy" in r] == [2, 4, 6]
    assert one[-1]["eval_loss"] < one[0]["eval_loss_initial"]  # it learns
    assert all(r["pairs"] == 13 for r in one)
    config = json.loads((runs["d1"] / "checkpoints" / f"step-{STEPS}" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["num_labels"] == 1
    final = {k: _load_all(r / "checkpoints" / f"step-{STEPS}") for k, r in runs.items()}
    assert "score.weight" in final["d1"] and "lm_head.weight" not in final["d1"]
    tp = _rows(runs["d1t2"])
    for a, b in zip(one, tp, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["accuracy"] == b["accuracy"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert one[-1]["eval_loss"] == pytest.approx(tp[-1]["eval_loss"], abs=1e-5)
    # A few single elements differ: Adam's m / sqrt(v) turns the all-reduces' rounding of
    # near-zero gradients into steps of the learning rate's size; the losses agree.
    assert _max_diff(final["d1"], final["d1t2"]) < 1e-3
    for run_dir in runs.values():
        _assert_no_processes_left(run_dir)

    # the reward model as the reward of an RL run: two steps of the CPU demo
    reward_model = runs["d1"] / "checkpoints" / f"step-{STEPS}"
    rl = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_cli.cli",
            "train",
            "recipes/tiny_rm_grpo.yaml",
            f"cluster.fileroot={tmp_path / 'rl'}",
            "total_train_steps=2",
            "model.path=builtin:tiny",
            f"reward.fn=model:{reward_model}",
            "logging.display=plain",
            f"launcher.trainer_port={free_port()}",
            f"launcher.inference_base_port={free_port()}",
            "rollout.batch_size=4",
            "rollout.group_size=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert rl.returncode == 0, rl.stdout[-3000:] + rl.stderr[-3000:]
    rows = _rows(tmp_path / "rl" / "tiny-rm-grpo" / "trial0")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # real scores: not the 0/1 of a checker, and no failed call
        assert r["reward_errors"] == 0 and r["reward_timeouts"] == 0
        assert r["reward_mean"] not in (0.0, 1.0)


def test_rm_resumes_after_kill_9_and_its_checkpoint_converts(
    tmp_path: Path, layouts: dict[str, Path]
) -> None:
    args = _args(tmp_path, STEPS, "allocation_mode=fsdp:d1", *LAYOUT_ARGS)
    run_dir = tmp_path / "tiny-rm" / "trial0"
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(lambda: handoff.latest(run_dir / "recover", "step-") is not None, 300, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    _assert_no_processes_left(run_dir)
    recovered = handoff.latest(run_dir / "recover", "step-")
    again = subprocess.run(
        args + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=400
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, STEPS + 1))
    log = (run_dir / "logs" / "trainer.log").read_text()
    done = recovered.version
    assert f"resumed from {recovered.path}: {done} steps done, going on with step {done + 1}" in log
    straight = layouts["d1"]  # uninterrupted: the same last step
    assert _rows(run_dir)[-1]["loss"] == pytest.approx(_rows(straight)[-1]["loss"], abs=1e-5)
    # DCP -> HF finds the scalar-head config (RUN/model-rm) by itself, and verifies
    newest = handoff.latest(run_dir / "recover", "step-")
    out = tmp_path / "hf"
    done = run_areal("convert-checkpoint", str(newest.path), str(out), "--verify")
    assert done.returncode == 0, done.stderr
    assert "max |logit difference| = 0" in done.stdout
    assert torch.equal(
        _load_all(out)["score.weight"],
        _load_all(run_dir / "checkpoints" / f"step-{STEPS}")["score.weight"],
    )
    back = run_areal(
        "convert-checkpoint", str(out), str(tmp_path / "dcp"), "--to", "dcp", "--verify"
    )
    assert back.returncode == 0, back.stderr
    _assert_no_processes_left(run_dir)
