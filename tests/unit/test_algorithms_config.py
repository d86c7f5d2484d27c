"""The recipe rules of issue 47's algorithms (DPO, distillation, rejection sampling,
prox_logp_method), each one line with exit 2 (or a warning), without a process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, areal_in_process

DEMO = str(REPO / "recipes" / "tiny_cpu.yaml")
DPO = str(REPO / "recipes" / "tiny_dpo.yaml")


@pytest.mark.parametrize(
    ("recipe", "override", "says"),
    [
        (DEMO, "actor.behav_imp_weight_cap=3.0", "is the short form of actor.rejection_sampling, and both are set"),
        (DEMO, "actor.rejection_sampling.upper=0.9", "upper 0.9 is not above 1"),
        (DEMO, "actor.rejection_sampling.metric=kl_k2 actor.rejection_sampling.action=clamp", "clamp bounds the importance ratio, but metric is kl_k2"),
        (DEMO, "actor.rejection_sampling.lower=1.5", "1.5 must lie between 0 and 1 for the ratio"),
        (DEMO, "actor.rejection_sampling.level=sequence allocation_mode=embedded:d1+fsdp:d1c2", "sequence needs each sequence on one rank"),
        (DEMO, "actor.rejection_sampling.level=often", "level"),
        (DEMO, "actor.prox_logp_method=guess", "prox_logp_method"),
        (DEMO, "teacher.path=builtin:huge", "teacher.path: unknown builtin model 'huge'"),
        (DEMO, "teacher.path=builtin:tiny teacher.rl_loss_weight=0 teacher.distill_loss_weight=0", "both 0, so nothing trains"),
        (DPO, "allocation_mode=fsdp:d1c2", "algorithm: dpo does not support context parallelism"),
        (DPO, "teacher.path=builtin:tiny", "teacher: is not used by algorithm: dpo"),
        (DPO, "actor.loss_type=hinge", "loss_type"),
    ],
)  # fmt: skip
def test_each_mistake_is_one_line_and_exit_2(recipe: str, override: str, says: str) -> None:
    done = areal_in_process("validate", recipe, *override.split())
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text('{"model_type": "llama", "vocab_size": 7}')
    done = areal_in_process("validate", DEMO, f"teacher.path={teacher}")
    assert done.returncode == 2 and "has vocab_size 7 but the student" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("recipe", "override", "says"),
    [
        (DEMO, "actor.beta=0.2", "actor.beta: is read by algorithm: dpo only, not grpo"),
        (DEMO, "actor.prox_logp_method=loglinear", "loglinear changes nothing with ppo_n_minibatches 1"),
        (DEMO, "teacher.distill_loss_weight=0.1", "teacher.distill_loss_weight: is not read without teacher.path"),
        (DEMO, "actor.use_decoupled_loss=false", "actor.rejection_sampling: is only read by the decoupled objective"),
    ],
)  # fmt: skip
def test_keys_that_would_do_nothing_warn(recipe: str, override: str, says: str) -> None:
    done = areal_in_process("validate", recipe, *override.split())
    assert done.returncode == 0 and says in done.stderr + done.stdout, done.stderr


def test_an_explicit_null_cap_says_how_to_turn_the_filter_off(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    text = (REPO / "recipes" / "tiny_cpu.yaml").read_text()
    start = text.index("  rejection_sampling:")
    end = text.index("  loss_agg_mode")
    recipe.write_text(text[:start] + "  behav_imp_weight_cap: null\n" + text[end:])
    done = areal_in_process("validate", str(recipe))
    assert done.returncode == 2 and "write actor.rejection_sampling.upper: null" in done.stderr


def test_the_dry_run_counts_the_frozen_models() -> None:
    from areal_cli.config.model_info import BUILTIN_ARCHITECTURES
    from areal_cli.config.phase_memory import frozen_models, param_count
    from areal_cli.config.schema import ExperimentConfig

    tiny = BUILTIN_ARCHITECTURES["tiny"]
    cfg = ExperimentConfig()
    assert frozen_models(cfg, tiny) == {}
    cfg.actor.kl_ctl = 0.1
    cfg.teacher.path = "builtin:small"
    assert frozen_models(cfg, tiny) == {
        "reference": param_count(tiny),
        "teacher": param_count(BUILTIN_ARCHITECTURES["small"]),
    }
    cfg.algorithm = "dpo"  # a reference, and no teacher outside RL
    assert frozen_models(cfg, tiny) == {"reference": param_count(tiny)}
