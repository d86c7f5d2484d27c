"""The rules of SAPO and M2PO (their losses: test_losses.py; layouts: gloo)."""

from __future__ import annotations

from tests.conftest import REPO, areal_in_process

DEMO = str(REPO / "recipes" / "tiny_cpu.yaml")


def test_sapo_needs_the_plain_objective_and_ignores_the_clip_keys() -> None:
    refused = areal_in_process("validate", DEMO, "actor.use_sapo_loss=true")
    assert refused.returncode == 2
    assert "SAPO is not built with the decoupled PPO objective" in refused.stderr
    assert "set actor.use_decoupled_loss: false" in refused.stderr
    ok = areal_in_process(
        "validate", DEMO, "actor.use_sapo_loss=true", "actor.use_decoupled_loss=false"
    )
    assert ok.returncode == 0, ok.stderr
    assert "actor.eps_clip: is not read by SAPO" in ok.stdout + ok.stderr


def test_m2_threshold_must_be_positive() -> None:
    done = areal_in_process("validate", DEMO, "actor.m2_threshold=0")
    assert done.returncode == 2 and "actor.m2_threshold: must be > 0" in done.stderr
