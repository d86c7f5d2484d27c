"""`areal import-recipe` (areal_cli.config.areal_import) on AReaL's own recipes, kept as
fixtures under tests/assets/areal_recipes/ with their licence header, and the one-line
answer that `areal validate` and `areal train` give an AReaL recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from areal_cli.config.areal_import import ImportRefused, import_recipe, looks_like_areal
from areal_cli.config.areal_import.convert import Imported, Specials, resolve_refs
from tests.conftest import REPO, run_areal

AREAL = REPO / "tests" / "assets" / "areal_recipes"
SCRIPT = AREAL / "gsm8k_rl.py.txt"


def _import(tmp_path: Path, name: str, *extra: str):
    out = tmp_path / (Path(name).stem + ".areal.yaml")
    result = run_areal("import-recipe", str(AREAL / name), "-o", str(out), *extra)
    return result, out


def test_gsm8k_grpo_imports_to_a_valid_recipe_that_plans_the_same_gpus(tmp_path: Path) -> None:
    result, out = _import(tmp_path, "gsm8k_grpo.yaml", "--script", str(SCRIPT))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header[0] == f"# Usage: areal train {out}"
    for line in (
        "#   actor.path -> model.path",
        "#   gconfig.n_samples -> rollout.group_size",
        "#   rollout.max_head_offpolicyness -> rollout.max_staleness",
        "#   rollout.backend and actor.backend -> allocation_mode: sglang:d4+fsdp:d4",
        "#   the entry script's gsm8k_reward_fn -> reward.fn: builtin:math",
        "#   total_train_epochs 10 -> total_train_steps: 300 (30 steps per epoch)",
        "#   perf_tracer.enabled: AReaL bookkeeping: areal works it out itself",
        "#   ref: actor.kl_ctl is 0, so no reference model is used",
    ):
        assert line in header, line
    assert any(
        "weight_update_mode xccl -> actor.weight_update.method: distributed" in line
        for line in header
    )
    recipe = yaml.safe_load(text)
    assert recipe["actor"]["adv_estimator"] == "custom"  # AReaL's math default, both norms
    assert recipe["actor"]["reward_norm"] == {"mean_level": "group", "std_level": "group"}
    assert recipe["actor"]["adv_norm"] == {"mean_level": "batch", "std_level": "batch"}
    assert recipe["actor"]["optimizer"]["eps"] == 1e-8 and recipe["rollout"]["group_size"] == 4
    fileroot = f"cluster.fileroot={tmp_path}/runs"
    checked = run_areal("validate", str(out), fileroot)
    assert checked.returncode == 0 and "error" not in checked.stderr, checked.stderr
    plan = run_areal("train", str(out), "--dry-run", "--json", fileroot)
    assert plan.returncode == 0, plan.stderr
    gpus = [g for p in json.loads(plan.stdout)["processes"] for g in p["gpus"]]
    assert len(gpus) == 8  # AReaL's sglang:d4p1t1 + fsdp:d4p1t1


def test_the_cpu_template_imports_for_vllm_on_cpu(tmp_path: Path) -> None:
    result, out = _import(tmp_path, "gsm8k_grpo_cpu.yaml")
    assert result.returncode == 0, result.stderr
    recipe = yaml.safe_load(out.read_text())
    assert recipe["allocation_mode"] == "vllm:d1+fsdp:d1"
    assert recipe["cluster"]["n_gpus_per_node"] == 0
    assert recipe["reward"]["fn"] == "builtin:math"  # the dataset's known script, said so
    assert "the reward of AReaL's openai/gsm8k scripts" in out.read_text()
    # its xccl: vLLM's weight transfer is NCCL only, so on a CPU the weights go by disk
    assert recipe["actor"]["weight_update"]["method"] == "disk"
    assert "vLLM receives weights over the network with NCCL only" in out.read_text()
    checked = run_areal("validate", str(out), f"cluster.fileroot={tmp_path}/runs")
    assert "actor.weight_update" not in checked.stderr, checked.stderr


def test_the_sft_recipe_imports_as_algorithm_sft(tmp_path: Path) -> None:
    result, out = _import(tmp_path, "gsm8k_sft.yaml")
    assert result.returncode == 0, result.stderr
    recipe = yaml.safe_load(out.read_text())
    assert recipe["algorithm"] == "sft" and recipe["allocation_mode"].startswith("fsdp:")
    assert "rollout" not in recipe and "gconfig" not in recipe
    checked = run_areal("validate", str(out), f"cluster.fileroot={tmp_path}/runs")
    assert checked.returncode == 0, checked.stderr


def test_dynamic_bs_and_the_overlong_penalty_carry_over(tmp_path: Path) -> None:
    result, out = _import(tmp_path, "gsm8k_dapo_dynamic_bs.yaml", "--script", str(SCRIPT))
    assert result.returncode == 0, result.stderr
    recipe = yaml.safe_load(out.read_text())
    assert recipe["rollout"]["dynamic_sampling"] and recipe["rollout"]["dynamic_bs"]
    assert recipe["actor"]["overlong_reward_penalty"] and recipe["actor"]["overlong_tokens"] == 512
    assert recipe["actor"]["eps_clip_higher"] == 0.28


def test_a_recipe_needing_a_missing_feature_is_refused_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "megatron.areal.yaml"
    out.write_text("# mine\n")
    recipe = AREAL / "gsm8k_grpo_megatron_lora.yaml"  # LoRA is built; Megatron is not
    result = run_areal("import-recipe", str(recipe), "-o", str(out))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs the Megatron backend, which areal lacks" in lines[0], lines
    assert "Traceback" not in result.stderr and out.read_text() == "# mine\n"  # untouched


def test_validate_and_train_point_an_areal_recipe_at_the_import() -> None:
    for command in ("validate", "train"):
        result = run_areal(command, str(AREAL / "gsm8k_grpo.yaml"))
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "this is an AReaL recipe" in lines[0], lines
        assert f"areal import-recipe {AREAL / 'gsm8k_grpo.yaml'} -o " in lines[0]


def test_areal_key_names_hint_at_areal_equivalents() -> None:
    result = run_areal(
        "validate", "recipes/tiny_cpu.yaml", "gconfig.n_samples=4", "recover.mode=auto",
        "rollout.max_head_offpolicyness=2",
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        "gconfig.n_samples: unknown key; this is AReaL's name: areal's is 'rollout.group_size'"
        in result.stderr
    )
    assert (
        "recover.mode: unknown key; this is AReaL's name: areal's is 'recover.freq_steps'"
        in result.stderr
    )
    assert "areal's is 'rollout.max_staleness'" in result.stderr
    assert "logging.wandb.mode" not in result.stderr


def test_references_resolve_within_the_file() -> None:
    data = {
        "a": {"path": "m", "n": 4},
        "b": "${a.path}",
        "c": "${a.n}",
        "d": "x-${a.path}-${a.n}",
        "e": "${nowhere.key}",
        "f": "${g}",
        "g": "${f}",
    }
    resolved, broken = resolve_refs(data)
    assert resolved["b"] == "m" and resolved["c"] == 4 and resolved["d"] == "x-m-4"
    assert resolved["e"] is None and resolved["f"] is None  # a cycle resolves to nothing
    assert "${nowhere.key}" in broken


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("sglang:d4p1t1+fsdp:d4p1t1", "sglang:d4+fsdp:d4"),
        ("sglang:d1+d1", "sglang:d1+fsdp:d1"),
        ("sglang:d2p1t2+d2p1t1c2", "sglang:d2t2+fsdp:d2c2"),
        ("vllm.d2p1t1+d2p1t1", "vllm:d2+fsdp:d2"),
    ],
)
def test_areal_older_allocation_forms(old: str, new: str) -> None:
    specials = Specials({"actor": {}}, Imported(), None)
    assert specials._old_allocation(old) == new


def test_pipeline_parallel_and_plain_areal_files_are_refused() -> None:
    specials = Specials({"actor": {}}, Imported(), None)
    with pytest.raises(ImportRefused, match="pipeline parallelism"):
        specials._old_allocation("sglang:d2p2t1+d4")
    with pytest.raises(ImportRefused, match="not an AReaL recipe"):
        import_recipe((REPO / "recipes" / "tiny_cpu.yaml").read_text(), "tiny_cpu.yaml")
    assert not looks_like_areal(yaml.safe_load((REPO / "recipes" / "tiny_cpu.yaml").read_text()))
    assert looks_like_areal(yaml.safe_load((AREAL / "gsm8k_sft.yaml").read_text()))


def test_every_key_of_the_fixtures_is_accounted_for(tmp_path: Path) -> None:
    """Each leaf key of an AReaL recipe is kept, renamed, dropped, changed or noted: the
    body and the header together name every one (none vanish silently)."""

    for name in ("gsm8k_grpo.yaml", "gsm8k_grpo_cpu.yaml", "gsm8k_sft.yaml"):
        text = (AREAL / name).read_text()
        _assert_every_key_said(name, text, import_recipe(text, name, SCRIPT.read_text()))


def _assert_every_key_said(name: str, text: str, imported: Imported) -> None:
    from areal_cli.config.areal_import.convert import flatten

    said = "\n".join(imported.changed + imported.dropped + imported.lost)
    data, _ = resolve_refs(yaml.safe_load(text))
    for key, _value in flatten(data):
        parts = key.split(".")
        named = any(
            f"{p}:" in said or f"{p} " in said
            for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
        )  # the key, or a section above it, begins a header line
        kept = imported.get(key, said) is not said  # carried over under its own name
        assert kept or named, (name, key)


def test_a_colocated_areal_allocation_imports_as_one_that_takes_turns(tmp_path: Path) -> None:
    """AReaL's '|' (colocated) stays '|', with the synchronous staleness and disk weight
    updates that colocation needs, and plans both sides on the same GPUs."""
    data = yaml.safe_load((AREAL / "gsm8k_grpo.yaml").read_text())
    data["allocation_mode"] = "sglang:d4p1t1|fsdp:d4p1t1"
    data["enable_offload"] = True
    source = tmp_path / "colocated.yaml"
    source.write_text(yaml.safe_dump(data))
    out = tmp_path / "colocated.areal.yaml"
    result = run_areal("import-recipe", str(source), "-o", str(out), "--script", str(SCRIPT))
    assert result.returncode == 0, result.stderr
    recipe = yaml.safe_load(out.read_text())
    assert recipe["allocation_mode"] == "sglang:d4|fsdp:d4"
    assert recipe["rollout"]["max_staleness"] == 0
    assert recipe["actor"]["weight_update"]["method"] == "disk"
    fileroot = f"cluster.fileroot={tmp_path}/runs"
    plan = run_areal("train", str(out), "--dry-run", "--json", fileroot)
    assert plan.returncode == 0, plan.stderr
    processes = json.loads(plan.stdout)["processes"]
    assert sorted({g for p in processes for g in p["gpus"]}) == [0, 1, 2, 3]
    assert processes[-1]["gpus"] == [0, 1, 2, 3] and "--colocated" in processes[-1]["argv"]


def test_a_folder_imports_every_yaml_with_a_table(tmp_path: Path) -> None:
    """import-recipe FOLDER: one row per YAML (imported, or refused and why), each import
    written under -o; without -o nothing is written and the line says how."""
    from tests.conftest import areal_in_process

    folder = REPO / "tests" / "assets" / "areal_recipes"
    out = tmp_path / "out"
    done = areal_in_process("import-recipe", str(folder), "-o", str(out))
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()[1:]}
    assert rows["gsm8k_grpo.yaml"] == "imported" and rows["gsm8k_grpo_lora.yaml"] == "imported"
    assert rows["gsm8k_grpo_megatron_lora.yaml"] == "refused"
    assert "needs the Megatron backend" in done.stdout
    assert (out / "gsm8k_grpo_lora.yaml").is_file()
    assert not (out / "gsm8k_grpo_megatron_lora.yaml").exists()
    assert done.stderr.strip() == "# 8 of 9 imported"  # the three agent examples too
    listed = areal_in_process("import-recipe", str(folder))
    assert listed.returncode == 0 and "pass -o OUT_DIR to write them" in listed.stderr
    only_refused = tmp_path / "refused"
    only_refused.mkdir()
    (only_refused / "a.yaml").write_text((folder / "gsm8k_grpo_megatron_lora.yaml").read_text())
    assert areal_in_process("import-recipe", str(only_refused)).returncode == 2
    with_script = areal_in_process("import-recipe", str(out), "--script", "x.py")
    assert (
        with_script.returncode == 2 and "--script goes with one recipe file" in with_script.stderr
    )


def test_areal_agent_configs_import_onto_areals_agents_and_online_mode(tmp_path: Path) -> None:
    """AReaL's agent examples: a library workflow becomes rollout.agent (areal's agent for
    the same SDK), the Agents SDK example's builder too, and the online example becomes
    rollout.mode online; each import validates (its agent loads), and every key is said."""
    expected = {
        "agent_workflow.yaml": ("rollout.agent", "areal_cli.agents.math_agents:OpenAIMathAgent"),
        "openai_agents.yaml": ("rollout.agent", "areal_cli.agents.math_agents:AgentsSdkMathAgent"),
        "openclaw.yaml": ("rollout.mode", "online"),
    }
    for name, (key, value) in expected.items():
        text = (AREAL / name).read_text()
        imported = import_recipe(text, name)
        assert imported.get(key) == value, name
        assert imported.get("reward.fn") is None  # the agent, or the session, rewards
        _assert_every_key_said(name, text, imported)
        result, out = _import(tmp_path, name)
        assert result.returncode == 0, result.stderr
        checked = run_areal("validate", str(out), f"cluster.fileroot={tmp_path}")
        assert checked.returncode == 0, checked.stderr
    online = import_recipe((AREAL / "openclaw.yaml").read_text(), "openclaw.yaml")
    assert online.get("rollout.proxy.admin_api_key") == "sk-test123456"
    assert online.get("dataset.path") is None and online.get("rollout.tool_parser") == "hermes"
    assert online.get("actor.reward_norm")["mean_level"] == "batch"  # a group of one


def test_agent_configs_needing_what_areal_lacks_name_it(tmp_path: Path) -> None:
    base = yaml.safe_load((AREAL / "agent_workflow.yaml").read_text())
    claude = {**base, "workflow": "areal.workflow.anthropic.claude_math_agent.MathToolAgent"}
    with pytest.raises(ImportRefused, match="the Claude Agent SDK"):
        import_recipe(yaml.safe_dump(claude), "claude.yaml")
    tau2 = {**base, "econfig": {"domain": "airline"}}
    with pytest.raises(ImportRefused, match="the tau2-bench environment"):
        import_recipe(yaml.safe_dump(tau2), "tau2.yaml")
    mine = {**base, "workflow": "my_agents.solver.Solver"}
    imported = import_recipe(yaml.safe_dump(mine), "mine.yaml")
    assert imported.get("rollout.agent") == "my_agents.solver:Solver"
    assert any("your own agent" in line for line in imported.lost)
