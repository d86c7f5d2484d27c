"""Loading recipes: composition, precedence, interpolation, paths, types."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_cli.config.errors import ConfigErrors
from areal_cli.config.loader import load_config, to_yaml
from areal_cli.config.schema import ExperimentConfig


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_precedence_defaults_then_recipe_then_overrides(tmp_path: Path) -> None:
    write(
        tmp_path / "yaml" / "base.yaml",
        "rollout:\n  batch_size: 16\n  group_size: 2\nactor:\n  eps_clip: 0.3\n",
    )
    recipe = write(
        tmp_path / "recipes" / "r.yaml",
        "defaults: [yaml/base.yaml]\nexperiment_name: e\nrollout:\n  group_size: 8\n",
    )
    cfg = load_config(recipe, ["rollout.batch_size=32"]).config
    assert cfg.rollout.batch_size == 32  # override beats defaults file
    assert cfg.rollout.group_size == 8  # recipe beats defaults file
    assert cfg.actor.eps_clip == 0.3  # defaults file beats dataclass default
    assert cfg.rollout.max_staleness == ExperimentConfig().rollout.max_staleness


def test_later_defaults_override_earlier_and_nest(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "seed: 1\ntrial_name: a\n")
    write(tmp_path / "b.yaml", "defaults: [a.yaml]\nseed: 2\n")
    recipe = write(tmp_path / "r.yaml", "defaults: [a.yaml, b.yaml]\n")
    cfg = load_config(recipe).config
    assert cfg.seed == 2 and cfg.trial_name == "a"


def test_interpolation_keeps_types_and_reads_defaults(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AREAL_TEST_ROOT", "/tmp/x")
    recipe = write(
        tmp_path / "r.yaml",
        "experiment_name: exp\n"
        "trial_name: ${experiment_name}-t${seed}\n"
        "rollout:\n  batch_size: 4\n  max_concurrent_rollouts: ${rollout.batch_size}\n"
        "cluster:\n  fileroot: ${env:AREAL_TEST_ROOT}/runs\n"
        "logging:\n  level: ${env:AREAL_UNSET_VAR,warning}\n",
    )
    cfg = load_config(recipe).config
    assert cfg.trial_name == "exp-t1"  # seed comes from the dataclass default
    assert cfg.rollout.max_concurrent_rollouts == 4 and isinstance(
        cfg.rollout.max_concurrent_rollouts, int
    )
    assert cfg.cluster.fileroot == "/tmp/x/runs"
    assert cfg.logging.level == "warning"


def test_override_values_are_yaml_typed(tmp_path: Path) -> None:
    recipe = write(tmp_path / "r.yaml", "experiment_name: e\n")
    cfg = load_config(
        recipe,
        [
            "actor.fsdp.offload_params=true",
            "eval.k=[1,2]",
            "actor.optimizer.lr=3e-4",
            "actor.eps_clip_higher=null",
        ],
    ).config
    assert cfg.actor.fsdp.offload_params is True
    assert cfg.eval.k == [1, 2]
    assert cfg.actor.optimizer.lr == pytest.approx(
        3e-4
    )  # PyYAML reads 3e-4 as text; float fields accept it
    assert cfg.actor.eps_clip_higher is None


def test_relative_paths_are_anchored_at_the_recipe(tmp_path: Path, monkeypatch) -> None:
    write(tmp_path / "recipes" / "data" / "d.jsonl", "{}\n")
    recipe = write(
        tmp_path / "recipes" / "r.yaml",
        "dataset:\n  path: data/d.jsonl\nmodel:\n  path: Qwen/Qwen2.5-1.5B\n",
    )
    monkeypatch.chdir(tmp_path.parent)
    cfg = load_config(recipe).config
    assert cfg.dataset.path == str((tmp_path / "recipes" / "data" / "d.jsonl").resolve())
    assert cfg.model.path == "Qwen/Qwen2.5-1.5B"  # a hub id stays as written


def test_command_line_paths_count_from_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    write(tmp_path / "cwd" / "data" / "d.jsonl", "{}\n")
    recipe = write(tmp_path / "recipes" / "r.yaml", "dataset:\n  path: data/other.jsonl\n")
    monkeypatch.chdir(tmp_path / "cwd")
    cfg = load_config(recipe, ["dataset.path=data/d.jsonl"]).config
    assert cfg.dataset.path == str((tmp_path / "cwd" / "data" / "d.jsonl").resolve())


def test_a_recipe_copied_anywhere_finds_the_packaged_fragments(tmp_path: Path, monkeypatch) -> None:
    from tests.conftest import REPO

    copy = write(
        tmp_path / "elsewhere" / "tiny_cpu.yaml", (REPO / "recipes" / "tiny_cpu.yaml").read_text()
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config(copy).config  # its defaults: yaml/cluster/local_cpu.yaml, ... (none here)
    assert cfg.cluster.n_gpus_per_node == 0 and cfg.inference.embedded.device == "cpu"
    # a fragment beside the recipe comes first
    write(tmp_path / "elsewhere" / "yaml" / "cluster" / "local_cpu.yaml", "cluster:\n  n_cpus: 7\n")
    assert load_config(copy).config.cluster.n_cpus == 7


def test_a_missing_fragment_names_where_it_looked(tmp_path: Path) -> None:
    recipe = write(tmp_path / "r.yaml", "defaults: [yaml/cluster/nope.yaml]\n")
    with pytest.raises(ConfigErrors) as err:
        load_config(recipe)
    (problem,) = err.value.problems
    assert "defaults file not found: yaml/cluster/nope.yaml" in problem.format()
    assert "yaml/cluster/local_cpu.yaml" in problem.format()  # what areal ships


def test_every_problem_is_reported_with_file_and_line(tmp_path: Path) -> None:
    recipe = write(
        tmp_path / "r.yaml",
        "experiment_name: e\nrollout:\n  batch_sise: 4\n  group_size: many\nactor:\n  eps_clip: 2\n",
    )
    with pytest.raises(ConfigErrors) as info:
        load_config(recipe, ["gconfig.temprature=0.5"])
    lines = [p.format() for p in info.value.problems]
    assert len(lines) == 4
    assert any(
        "r.yaml:3: rollout.batch_sise: unknown key; did you mean 'rollout.batch_size'?" in x
        for x in lines
    )
    assert any("r.yaml:4: rollout.group_size: expected an integer" in x for x in lines)
    assert any("r.yaml:6: actor.eps_clip: must be < 1" in x for x in lines)
    assert any(
        "command line: gconfig.temprature: unknown key; did you mean 'gconfig.temperature'?" in x
        for x in lines
    )


def test_unknown_key_in_wrong_section_points_to_the_right_one(tmp_path: Path) -> None:
    recipe = write(tmp_path / "r.yaml", "max_staleness: 2\n")
    with pytest.raises(ConfigErrors) as info:
        load_config(recipe)
    assert "did you mean 'rollout.max_staleness'?" in info.value.problems[0].format()


def test_resolved_yaml_round_trips(tmp_path: Path) -> None:
    recipe = write(tmp_path / "r.yaml", "experiment_name: e\nrollout:\n  batch_size: 5\n")
    cfg = load_config(recipe).config
    again = load_config(write(tmp_path / "resolved.yaml", to_yaml(cfg))).config
    assert again == cfg


def test_public_key_paths_exist() -> None:
    import dataclasses

    cfg = ExperimentConfig()
    for path in [
        "experiment_name",
        "trial_name",
        "allocation_mode",
        "model.path",
        "cluster.fileroot",
        "actor.optimizer.lr",
        "actor.fsdp.offload_params",
        "actor.mb_spec.max_tokens_per_mb",
        "rollout.max_staleness",
        "rollout.batch_size",
        "rollout.group_size",
        "gconfig.max_new_tokens",
        "gconfig.temperature",
    ]:
        *sections, leaf = path.split(".")
        node = cfg
        for part in sections:
            node = getattr(node, part)
        assert leaf in {f.name for f in dataclasses.fields(node)}, f"{path} is no config field"


def test_every_field_has_a_doc() -> None:
    import dataclasses
    import typing

    def walk(cls: type) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name])

    walk(ExperimentConfig)
