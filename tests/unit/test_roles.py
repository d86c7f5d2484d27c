"""Each trainer role, in this process: one gloo rank (a FileStore, world size 1), the tiny
model, real steps. Each role's step changes the weights with a finite loss and records its
own figures, and its state round-trips: a step after a recover entry is loaded equals the
same step of the run that never stopped."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from areal_cli.config.schema import ExperimentConfig, ParallelStrategy
from areal_cli.models.tiny_model import build_tiny_model
from areal_cli.rundir.heartbeat import Heartbeat
from areal_cli.rundir.records import TrainerStep
from areal_cli.trainer.main import build_role, initial_model
from areal_cli.trainer.state import Role, TrainerState
from tests.conftest import write_jsonl
from tests.gloo.conftest import make_batches


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("roles") / "model", seed=0)


@pytest.fixture
def one_rank(tmp_path: Path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _config(model_dir: Path, algorithm: str) -> ExperimentConfig:
    cfg = ExperimentConfig()
    cfg.algorithm = algorithm
    cfg.model.path = str(model_dir)
    cfg.total_train_steps = 2
    cfg.recover.freq_steps = 1
    cfg.saver.freq_steps = 0
    cfg.actor.optimizer.lr = 1e-2
    cfg.actor.kl_ctl = 0.0
    return cfg


def _setup(cfg: ExperimentConfig, run_dir: Path, batches: Path | None) -> tuple[TrainerState, Role]:
    beat = Heartbeat(run_dir, "trainer-0")
    model_dir = initial_model(cfg, run_dir, beat)
    state = TrainerState.build(cfg, run_dir, beat, "cpu", ParallelStrategy(), model_dir)
    role = build_role(state, batches)
    state.extra = role.models()
    return state, role


def _weights(state: TrainerState) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{k}": v.detach().clone()
        for name, t in state.trainables().items()
        for k, v in t.model.state_dict().items()
    }


def _lines(run_dir: Path) -> list[TrainerStep]:
    text = (run_dir / "logs" / "trainer-metrics.jsonl").read_text()
    return [TrainerStep.from_json(line) for line in text.splitlines()]


def _straight_and_resumed(
    cfg: ExperimentConfig, tmp_path: Path, batches: Path | None = None
) -> tuple[TrainerState, list[TrainerStep], TrainerState, list[TrainerStep]]:
    """Steps 1 and 2 in one state; then step 2 again in a new state loaded from the
    recover entry of step 1."""
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    state, role = _setup(cfg, straight_dir, batches)
    role.begin(state, 0, 2)
    initial = _weights(state)
    state.run_step(role, 1)
    after_one = _weights(state)
    assert any(not torch.equal(initial[k], after_one[k]) for k in initial)  # it learned
    shutil.copytree(straight_dir / "recover", resumed_dir / "recover")
    state.run_step(role, 2)
    again, again_role = _setup(cfg, resumed_dir, batches)
    done = again.resume()
    assert done == 1
    assert all(torch.equal(after_one[k], v) for k, v in _weights(again).items())
    again_role.begin(again, done, 2)
    again.run_step(again_role, 2)
    return state, _lines(straight_dir), again, _lines(resumed_dir)


def _same_step(a: TrainerStep, b: TrainerStep, names: tuple[str, ...]) -> None:
    assert a.step == b.step
    for name in names:
        assert a.figures[name] == pytest.approx(b.figures[name], rel=1e-6, abs=1e-7), name


def _same_weights(a: TrainerState, b: TrainerState) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert float((wa[k] - wb[k]).abs().max()) < 1e-6, k


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_actor_learns_publishes_and_resumes(
    tmp_path: Path, model_dir: Path, one_rank: None, algorithm: str
) -> None:
    cfg = _config(model_dir, algorithm)
    cfg.critic.lr = 1e-2
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batches = make_batches(tmp_path / "batches", 2, n_seqs=4, group_size=2, vocab=vocab)
    straight, lines, resumed, resumed_lines = _straight_and_resumed(cfg, tmp_path, batches)
    first = lines[0]
    assert [r.step for r in lines] == [1, 2] and first.weight_version == 1
    assert math.isfinite(first.figures["loss"]) and first.figures["grad_norm"] > 0
    assert first.publish_s > 0 and first.peak_rss_mb > 0 and first.state_mb > 0
    assert (straight.run.weights / "v2" / "model.safetensors").exists()
    names = ("loss", "grad_norm", "entropy", "clip_frac")
    if algorithm == "ppo":
        assert set(straight.extra) == {"critic"}
        assert math.isfinite(first.figures["value_loss"]) and first.figures["critic_grad_norm"] > 0
        assert "explained_variance" in first.figures and "critic_lr" in first.figures
        saved = json.loads((straight.run.recover / "step-2" / "state.json").read_text())
        assert {"scheduler", "critic_scheduler"} <= saved.keys()
        names += ("value_loss", "critic_grad_norm", "value_mean")
    else:
        assert "value_loss" not in first.figures and not straight.extra
    # the resumed run republished v1 (the restored weights), then published v2
    assert (resumed.run.weights / "v1").exists() and (resumed.run.weights / "v2").exists()
    _same_step(lines[1], resumed_lines[-1], names)
    _same_weights(straight, resumed)


def test_sft_trains_on_answers_evaluates_and_resumes(
    tmp_path: Path, model_dir: Path, one_rank: None
) -> None:
    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(6)]
    cfg = _config(model_dir, "sft")
    cfg.dataset.path = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg.sft.eval_path = write_jsonl(tmp_path / "eval.jsonl", rows[:2])
    cfg.sft.batch_size = 3
    cfg.sft.eval_freq_steps = 1
    straight, lines, resumed, resumed_lines = _straight_and_resumed(cfg, tmp_path)
    first = lines[0]
    assert first.weight_version is None and not (straight.run.weights).exists()
    assert math.isfinite(first.figures["loss"]) and first.figures["nll"] > 0
    assert {"eval_loss", "eval_loss_initial", "loss_tokens"} <= first.figures.keys()
    assert "eval_loss_initial" not in lines[1].figures  # only step 1 carries the start
    _same_step(lines[1], resumed_lines[-1], ("loss", "nll", "grad_norm", "eval_loss"))
    _same_weights(straight, resumed)


def test_the_reward_model_learns_pairs_and_resumes(
    tmp_path: Path, model_dir: Path, one_rank: None
) -> None:
    rows = [
        {"prompt": f"What is {i}+1?", "chosen": str(i + 1), "rejected": str(i + 7)}
        for i in range(6)
    ]
    cfg = _config(model_dir, "rm")
    cfg.dataset.path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg.rm.eval_path = write_jsonl(tmp_path / "held_out.jsonl", rows[:2])
    cfg.rm.batch_size = 3
    straight, lines, resumed, resumed_lines = _straight_and_resumed(cfg, tmp_path)
    first = lines[0]
    assert straight.run.scalar_model.exists()  # the scalar head on the tiny model's body
    assert math.isfinite(first.figures["loss"]) and first.figures["pairs"] == 3
    assert {"accuracy", "margin", "chosen_score", "eval_accuracy_initial"} <= first.figures.keys()
    assert "eval_accuracy" in lines[1].figures  # the last step evaluates
    _same_step(lines[1], resumed_lines[-1], ("loss", "accuracy", "margin", "grad_norm"))
    _same_weights(straight, resumed)


@pytest.mark.parametrize(
    ("allocation", "dp", "cp", "tp"),
    [("embedded:d1+fsdp:d2", 2, 1, 1), ("embedded:d1+fsdp:d2t2", 2, 1, 2)],
)
def test_the_trainer_takes_the_planned_layout_as_flags(
    allocation: str, dp: int, cp: int, tp: int
) -> None:
    """The launcher passes the train side it parsed; the trainer reads the flags back."""
    from areal_cli.trainer.main import parse_args, train_strategy
    from tests.unit.test_plan import _plan

    _, _, plan = _plan("tiny_cpu.yaml", f"allocation_mode={allocation}", "cluster.n_cpus=5")
    argv = plan.processes[-1].argv
    args = parse_args(argv[argv.index("areal_cli.trainer.main") + 1 :])
    want = ParallelStrategy(
        data_parallel_size=dp, context_parallel_size=cp, tensor_parallel_size=tp
    )
    assert train_strategy(args, dp * cp * tp) == want
    alone = train_strategy(parse_args(["--config", "c.yaml"]), 3)  # no flags: all data parallel
    assert alone == ParallelStrategy(data_parallel_size=3)
