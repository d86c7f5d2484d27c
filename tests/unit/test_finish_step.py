"""A step's metrics line is on record before its recover entry exists (a kill between the
two must lose the entry, which the resume redoes, never the line)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from areal_cli.config.schema import ExperimentConfig
from areal_cli.rundir.heartbeat import Heartbeat
from areal_cli.rundir.paths import RunDir
from areal_cli.rundir.records import TrainerStep
from areal_cli.trainer import state as trainer_state


class Killed(Exception):
    pass


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_the_line_is_written_before_the_recover_entry(tmp_path, one_rank, monkeypatch) -> None:
    def save_recover(*args, **kwargs):
        line = (tmp_path / "logs" / "trainer-metrics.jsonl").read_text()
        assert TrainerStep.from_json(line).step == 2
        raise Killed  # the process dies while it writes the entry

    monkeypatch.setattr(trainer_state, "save_recover", save_recover)
    cfg = ExperimentConfig()
    cfg.recover.freq_steps, cfg.saver.freq_steps = 2, 0
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    run = RunDir(tmp_path)
    actor = trainer_state.Trainable(model, optimizer, scheduler, tmp_path, run.checkpoints)
    beat = Heartbeat(tmp_path, "trainer-0")
    beat.steps_done = 1
    state = trainer_state.TrainerState(cfg, run, beat, None, None, actor)  # no mesh needed
    with pytest.raises(Killed):
        state.finish_step(TrainerStep(step=2, train_s=0.1, figures={"loss": 0.5}))
    assert beat.steps_done == 1  # step 2 (due for recover every 2 steps) not counted as done


def test_a_restarted_controller_takes_a_steps_rollout_figures_from_its_batch(tmp_path) -> None:
    """A controller killed between writing step N's batch and step N's metrics line:
    the next one writes the line with N's reward figures, read from the batch entry."""
    from areal_cli.rollout.batch import stored_stats
    from areal_cli.rundir.batch import RolloutBatch, write_batch

    batch = RolloutBatch(
        input_ids=torch.zeros(4, dtype=torch.int64),
        loss_mask=torch.ones(4, dtype=torch.int8),
        logprobs=torch.zeros(4),
        versions=torch.zeros(4, dtype=torch.int32),
        seqlens=torch.tensor([4]),
        rewards=torch.tensor([1.0]),
        group_size=1,
    )
    stats = {"reward_mean": 0.75, "staleness_mean": 1.0}
    write_batch(tmp_path / "rollouts", 9, batch, {"data_state": {}, "stats": stats})
    assert stored_stats(tmp_path, 9) == stats
    assert stored_stats(tmp_path, 10) == {}  # no batch: the line has the trainer's part


def test_gen_tokens_per_s_is_tokens_over_busy_time_of_the_last_batches() -> None:
    from areal_cli.rollout.batch import gen_rate
    from areal_cli.rollout.state import GEN_RATE_WINDOW, LoopState

    state = LoopState(version=0, next_step=1)
    client = SimpleNamespace(generated_tokens=0, busy_s=lambda: 0.0)
    rates = []
    for k in range(1, 9):  # 100 tokens and one busy second per batch, whatever the wall time
        busy = float(k)
        client.generated_tokens, client.busy_s = 100 * k, (lambda b=busy: b)
        rates.append(gen_rate(state, client))
    assert rates == [100.0] * 8  # steady however the batches' wall times vary
    assert len(state.gen_marks) == GEN_RATE_WINDOW + 1
    client.busy_s = lambda: 8.0  # no call in flight since the last batch, no new tokens
    assert gen_rate(state, client) == 100.0
