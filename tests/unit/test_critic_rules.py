"""What a PPO recipe (algorithm: ppo) may carry: the critic section only under ppo, no
group-advantage estimator, no context parallelism, a critic.path that exists."""

from __future__ import annotations

import pytest

from tests.conftest import run_areal


@pytest.mark.parametrize(
    ("recipe", "override", "message"),
    [
        ("recipes/tiny_cpu.yaml", "critic.lr=1e-3", "critic: is only read by algorithm: ppo"),
        ("recipes/tiny_ppo.yaml", "actor.adv_estimator=rloo", "actor.adv_estimator: is not used by algorithm: ppo"),
        ("recipes/tiny_ppo.yaml", "allocation_mode=embedded:d1+fsdp:d1c2", "algorithm: ppo does not support context parallelism"),
        ("recipes/tiny_ppo.yaml", "critic.gamma=1.5", "critic.gamma"),
    ],
)  # fmt: skip
def test_bad_ppo_keys_are_refused(recipe: str, override: str, message: str) -> None:
    result = run_areal("validate", recipe, override)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_critic_path_warns_in_a_plan_and_stops_a_run(tmp_path) -> None:
    missing = f"critic.path={tmp_path / 'no-critic'}"
    plan = run_areal(
        "train", "recipes/tiny_ppo.yaml", "--dry-run", missing, f"cluster.fileroot={tmp_path}"
    )
    assert plan.returncode == 0 and "a real run needs it" in plan.stdout + plan.stderr
    assert "critic (a value model) trains on the trainer's ranks" in plan.stdout
    run = run_areal("train", "recipes/tiny_ppo.yaml", missing, f"cluster.fileroot={tmp_path}")
    assert run.returncode == 2 and "critic.path" in run.stderr, run.stdout + run.stderr
    assert not (tmp_path / "tiny-ppo").exists()
