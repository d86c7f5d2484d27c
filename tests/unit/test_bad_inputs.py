"""Bad input never starts anything: exit 2, one line per problem naming the key or file,
no traceback, and nothing written. Each case runs the real CLI in a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_areal, snapshot

BASE = """\
experiment_name: bad
trial_name: t0
allocation_mode: embedded:d1+fsdp:d2
cluster:
  fileroot: ./runs
  n_gpus_per_node: 0
  n_cpus: 2
model:
  path: builtin:tiny
rollout:
  batch_size: 4
  group_size: 2
dataset:
  path: data.jsonl
"""

GPU_BASE = BASE.replace("embedded:d1+fsdp:d2", "sglang:d4t1+fsdp:d4").replace(
    "n_gpus_per_node: 0", "n_gpus_per_node: 8"
)


def _set(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


# (id, recipe text or None for BASE, overrides, expected fragments: one per problem line)
CASES = [
    (
        "unknown-top-key",
        BASE + "experimet_name: x\n",
        [],
        ["experimet_name: unknown key; did you mean 'experiment_name'?"],
    ),
    (
        "unknown-nested-key",
        BASE + "actor:\n  optimizer:\n    lrr: 0.1\n",
        [],
        ["actor.optimizer.lrr: unknown key; did you mean 'actor.optimizer.lr'?"],
    ),
    (
        "unknown-key-wrong-section",
        BASE + "max_staleness: 1\n",
        [],
        ["did you mean 'rollout.max_staleness'?"],
    ),
    (
        "unknown-override-key",
        None,
        ["rollout.max_stalenes=2"],
        ["command line: rollout.max_stalenes: unknown key; did you mean 'rollout.max_staleness'?"],
    ),
    ("malformed-override", None, ["rollout.max_staleness"], ["not of the form key.path=value"]),
    (
        "wrong-type-int",
        _set(BASE, "batch_size: 4", "batch_size: four"),
        [],
        ["rollout.batch_size: expected an integer, got text"],
    ),
    (
        "wrong-type-bool",
        BASE + "actor:\n  fsdp:\n    offload_params: maybe\n",
        [],
        ["actor.fsdp.offload_params: expected true/false"],
    ),
    ("wrong-type-list", BASE + "eval:\n  k: 4\n", [], ["eval.k: expected a list"]),
    ("section-as-scalar", BASE + "actor: 3\n", [], ["actor: expected a section of keys"]),
    (
        "override-wrong-type",
        None,
        ["gconfig.max_new_tokens=lots"],
        ["command line: gconfig.max_new_tokens: expected an integer"],
    ),
    (
        "lr-out-of-range",
        BASE + "actor:\n  optimizer:\n    lr: -0.1\n",
        [],
        ["actor.optimizer.lr: must be > 0"],
    ),
    ("top-p-out-of-range", BASE + "gconfig:\n  top_p: 1.5\n", [], ["gconfig.top_p: must be <= 1"]),
    (
        "bad-choice",
        BASE + "actor:\n  adv_estimator: grpoo\n",
        [],
        ["actor.adv_estimator: 'grpoo' is not one of"],
    ),
    (
        "negative-staleness",
        _set(BASE, "  group_size: 2\n", "  group_size: 2\n  max_staleness: -1\n"),
        [],
        ["rollout.max_staleness: must be >= 0, got -1"],
    ),
    ("yaml-syntax", BASE + "gconfig:\n  temperature: [1.0\n", [], ["YAML syntax error"]),
    ("yaml-top-level-list", "- a\n- b\n", [], ["the top level must be a mapping"]),
    ("duplicate-key", BASE + "seed: 1\nseed: 2\n", [], ["seed: duplicate key"]),
    (
        "missing-defaults-file",
        "defaults: [yaml/nope.yaml]\n" + BASE,
        [],
        ["defaults file not found: yaml/nope.yaml"],
    ),
    (
        "broken-interpolation",
        BASE + "logging:\n  level: ${rollout.batchsize}\n",
        [],
        ["broken interpolation ${rollout.batchsize}"],
    ),
    (
        "interpolation-cycle",
        BASE
        + "launcher:\n  trainer_port: ${launcher.inference_base_port}\n  inference_base_port: ${launcher.trainer_port}\n",
        [],
        ["interpolation cycle", "interpolation cycle"],
    ),
    (
        "unset-env-var",
        BASE + "logging:\n  level: ${env:AREAL_SURELY_UNSET}\n",
        [],
        ["environment variable AREAL_SURELY_UNSET is not set"],
    ),
    (
        "malformed-allocation",
        _set(BASE, "embedded:d1+fsdp:d2", "embedded:d1+fsdp"),
        [],
        ["allocation_mode: component 'fsdp' has no ':dims' part"],
    ),
    (
        "unknown-backend",
        _set(BASE, "embedded:d1+fsdp:d2", "embeded:d1+fsdp:d2"),
        [],
        ["unknown backend 'embeded'; did you mean 'embedded'?"],
    ),
    (
        "bad-dimension",
        _set(BASE, "embedded:d1+fsdp:d2", "embedded:d1+fsdp:d2x2"),
        [],
        ["unknown dimension 'x'"],
    ),
    (
        "fsdp-pipeline",
        _set(BASE, "embedded:d1+fsdp:d2", "embedded:d1+fsdp:d2p2"),
        [],
        ["fsdp cannot do pipeline parallelism"],
    ),
    (
        "no-trainer",
        _set(BASE, "embedded:d1+fsdp:d2", "embedded:d1"),
        [],
        ["has no trainer component"],
    ),
    (
        "world-size-vs-cluster",
        _set(GPU_BASE, "sglang:d4t1+fsdp:d4", "sglang:d4t2+fsdp:d4"),
        [],
        ["needs 12 GPUs (sglang 8 + fsdp 4) but the cluster declares 8"],
    ),
    (
        "sglang-on-cpu",
        _set(BASE, "embedded:d1+fsdp:d2", "sglang:d1+fsdp:d2"),
        [],
        ["sglang needs GPUs"],
    ),
    (
        "cpu-cores",
        _set(BASE, "embedded:d1+fsdp:d2", "embedded:d2+fsdp:d2"),
        [],
        ["cluster.n_cpus: the allocation needs at least 3 CPU cores"],
    ),
    (
        "batch-not-divisible",
        _set(_set(BASE, "batch_size: 4", "batch_size: 3"), "group_size: 2", "group_size: 3"),
        [],
        ["9 samples cannot be split evenly over 2 trainer ranks"],
    ),
    (
        "group-size-one",
        _set(BASE, "group_size: 2", "group_size: 1"),
        ["rollout.batch_size=4"],
        ["rollout.group_size: grpo compares samples within a group"],
    ),
    (
        "missing-dataset",
        _set(BASE, "path: data.jsonl", "path: nowhere/data.jsonl"),
        [],
        ["dataset.path: dataset path does not exist"],
    ),
    (
        "unknown-builtin-model",
        _set(BASE, "path: builtin:tiny", "path: builtin:huge"),
        [],
        ["unknown builtin model 'huge'"],
    ),
    (
        "reward-module-missing",
        BASE + "reward:\n  fn: my_rewards:score\n",
        [],
        ["reward.fn: module 'my_rewards' not found"],
    ),
    (
        "reward-function-missing",
        BASE + "reward:\n  fn: rewards:scor\n",
        [],
        ["rewards.py has no class or function named 'scor' (it defines: score)"],
    ),
    (
        "eval-k-too-large",
        BASE + "eval:\n  n_samples: 2\n  k: [1, 4]\n",
        [],
        ["eval.k[1]: pass@4 needs 1 <= k <= n_samples (2)"],
    ),
    (
        "offload-on-cpu",
        BASE + "actor:\n  fsdp:\n    offload_params: true\n",
        [],
        ["actor.fsdp.offload_params: needs an accelerator"],
    ),
    (
        "bad-experiment-name",
        _set(BASE, "experiment_name: bad", "experiment_name: a/b"),
        [],
        ["experiment_name: 'a/b' is not a safe directory name"],
    ),
    (
        "ray-trainer-over-nodes",
        _set(BASE, "n_gpus_per_node: 0", "n_gpus_per_node: 4"),
        ["launcher.type=ray", "cluster.n_nodes=3", "allocation_mode=sglang:d4+fsdp:d8"],
        ["under Ray the trainer's ranks are packed on one node"],
    ),
    (
        "slurm-options",
        BASE
        + "launcher:\n  type: slurm\n  slurm:\n    time: 2 hours\n    extra_sbatch: [constraint=a100]\n",
        [],
        [
            "launcher.slurm.time: '2 hours' is not a Slurm time limit",
            "recipe.yaml:19: launcher.slurm.extra_sbatch[0]: 'constraint=a100' is not one option",
        ],
    ),
    (
        "trainer-ranks-over-nodes",
        None,
        ["launcher.type=slurm", "cluster.n_nodes=3", "cluster.n_cpus=4"],
        ["the trainer's 2 ranks do not split evenly over cluster.n_nodes=3 nodes"],
    ),
    (
        "tokenizer-mismatch",
        _set(BASE, "path: builtin:tiny", "path: fake_model"),
        [],
        ["the tokenizer produces token id 20 but the model embeds only 10 tokens"],
    ),
    (
        "unknown-key-and-cross-field",
        _set(_set(BASE, "batch_size: 4", "batch_size: 3"), "group_size: 2", "group_size: 3"),
        ["rollout.max_stalenes=2"],
        ["did you mean 'rollout.max_staleness'?", "9 samples cannot be split evenly"],
    ),
    (
        "many-problems-at-once",
        _set(
            _set(BASE, "batch_size: 4", "batch_size: 0"),
            "trial_name: t0",
            "trial_name: t0\nbogus: 1",
        ),
        ["gconfig.top_k=-5"],
        ["bogus: unknown key", "rollout.batch_size: must be >= 1", "gconfig.top_k: must be >= -1"],
    ),
    (
        # A value error and a cross-field error of other keys: both in one pass.
        "range-and-cross-field-at-once",
        None,
        ["rollout.batch_size=3", "rollout.group_size=3", "actor.optimizer.lr=-1"],
        ["actor.optimizer.lr: must be > 0", "9 samples cannot be split evenly"],
    ),
    (
        # Cross-field rules that read a broken key are skipped (they would judge a
        # default), the others still run: the batch split is not reported on group_size
        # 'abc', the port clash is.
        "broken-value-skips-only-its-rules",
        BASE + "launcher:\n  trainer_port: 30000\n  inference_base_port: 30000\n",
        ["rollout.group_size=abc", "rollout.batch_size=3", "launcher.type=slurmm"],
        [
            "rollout.group_size: expected an integer",
            "launcher.type: 'slurmm' is not one of",
            "launcher.trainer_port: 30000 is also an inference server's port",
        ],
    ),
]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tmp_path / "rewards.py").write_text("def score(sample):\n    return 1.0\n")
    fake = tmp_path / "fake_model"
    fake.mkdir()
    (fake / "config.json").write_text(
        json.dumps({"vocab_size": 10, "architectures": ["LlamaForCausalLM"]})
    )
    (fake / "tokenizer.json").write_text(
        json.dumps({"model": {"vocab": {"a": 0, "b": 20}}, "added_tokens": []})
    )
    return tmp_path


@pytest.mark.parametrize("name,recipe,overrides,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input(
    workdir: Path, name: str, recipe: str | None, overrides: list[str], expected: list[str]
) -> None:
    path = workdir / "recipe.yaml"
    path.write_text(BASE if recipe is None else recipe)
    before = snapshot(workdir)
    for command in (["validate"], ["train", "--dry-run"]):
        result = run_areal(*command, "recipe.yaml", *overrides, cwd=workdir)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr + result.stdout
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == len(expected), result.stderr
        for fragment in expected:
            assert any(fragment in line for line in errors), (
                f"{fragment!r} not in:\n{result.stderr}"
            )
        for line in errors:  # each line says where: a file:line, the command line, or a key
            assert "recipe.yaml" in line or "command line" in line or ".yaml" in line
        assert result.stderr.rstrip().endswith("nothing was started.")
    assert snapshot(workdir) == before, "a failed command wrote files"


def test_missing_recipe(workdir: Path) -> None:
    result = run_areal("validate", "nope.yaml", cwd=workdir)
    assert result.returncode == 2
    assert (
        result.stderr.splitlines()[0]
        == "error: nope.yaml: recipe not found: nope.yaml; check the path (recipes live in recipes/)"
    )


def test_case_count() -> None:
    assert len(CASES) + 1 >= 25


def test_repo_recipes_are_untouched_by_failures() -> None:
    before = snapshot(REPO / "recipes")
    result = run_areal("train", "recipes/tiny_cpu.yaml", "--dry-run", "rollout.batch_size=-3")
    assert result.returncode == 2
    assert snapshot(REPO / "recipes") == before


def test_missing_model_warns_on_plans_and_stops_a_real_run(workdir: Path) -> None:
    """A plan needs no weights (validate/--dry-run warn); `areal train` refuses to start."""
    (workdir / "recipe.yaml").write_text(_set(BASE, "path: builtin:tiny", "path: ./models/none"))
    planned = run_areal("validate", "recipe.yaml", cwd=workdir)
    assert (
        planned.returncode == 0
        and "warning: recipe.yaml:9: model.path: model path does not exist yet" in planned.stderr
    )
    before = snapshot(workdir)
    real = run_areal("train", "recipe.yaml", cwd=workdir)
    assert (
        real.returncode == 2
        and "error: recipe.yaml:9: model.path: model path does not exist" in real.stderr
    )
    assert "Traceback" not in real.stderr and snapshot(workdir) == before


# (id, the bad line after a good one in data.jsonl, what the error line says of it)
BAD_ROWS = [
    ("invalid-utf8", b'{"prompt": "1+1", "answer": "\xff"}', "invalid UTF-8 at line 2"),
    ("invalid-json", b'{"prompt": "1+1", "answer":', "invalid JSON at line 2"),
    ("missing-prompt", b'{"answer": "2"}', "no 'prompt' at line 2"),
    ("prompt-type", b'{"prompt": 12, "answer": "2"}', "a 'prompt' that is not text"),
    ("missing-answer", b'{"prompt": "1+1"}', "no 'answer' at line 2"),
    ("answer-type", b'{"prompt": "1+1", "answer": [2]}', "an 'answer' that is not text"),
    (
        "prompt-too-long",
        json.dumps({"prompt": "one plus one " * 600, "answer": "2"}).encode(),
        "a prompt over max_prompt_len=1024 tokens at line 2",
    ),
]


@pytest.mark.parametrize("name,line,expected", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_a_bad_row_stops_a_real_run_under_on_bad_row_error(
    workdir: Path, name: str, line: bytes, expected: str
) -> None:
    (workdir / "data.jsonl").write_bytes(b'{"prompt": "1+1", "answer": "2"}\n' + line + b"\n")
    (workdir / "recipe.yaml").write_text(BASE)
    before = snapshot(workdir)
    real = run_areal("train", "recipe.yaml", "dataset.on_bad_row=error", cwd=workdir)
    assert real.returncode == 2, real.stderr
    errors = [line for line in real.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], real.stderr
    assert "data.jsonl has 1 bad row" in errors[0] and "dataset.on_bad_row: skip" in errors[0]
    assert real.stderr.rstrip().endswith("nothing was started.")
    assert "Traceback" not in real.stderr and snapshot(workdir) == before
