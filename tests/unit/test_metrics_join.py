"""The metrics join (areal_cli.rollout.metrics) and the supervised relay
(areal_cli.launch.follow): the trainer's records, read back as `TrainerStep`s from a real
RUN/logs/trainer-metrics.jsonl, become the lines of RUN/metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from areal_cli.launch.follow import supervised_metrics
from areal_cli.rollout.metrics import MetricsJoin, build_metrics, steps_in
from areal_cli.rundir.paths import RunDir
from areal_cli.rundir.records import TrainerStep

ROLLOUT = {"reward_mean": 0.5, "staleness_max": 1.0, "rollout_save_s": 0.01}
HANDOFF = {"handoff_load_s": 0.2, "handoff_latency_s": 0.3, "handoff_total_s": 0.4}


def rl_record(step: int) -> TrainerStep:
    return TrainerStep(
        step=step,
        train_s=1.5,
        figures={"loss": -0.25, "grad_norm": 0.5, "kl": 0.01, "not_carried": 9.0},
        weight_version=step,
        wait_s=0.1,
        publish_s=0.2,
        peak_rss_mb=900.0,
        state_mb=12.0,
    )


def test_a_line_joins_rollout_trainer_and_handoff_figures_in_order() -> None:
    line = build_metrics(rl_record(3), ROLLOUT, HANDOFF)
    assert isinstance(line.pop("time"), float)
    assert list(line.items()) == [
        ("step", 3),
        ("weight_version", 3),
        ("reward_mean", 0.5),
        ("staleness_max", 1.0),
        ("rollout_save_s", 0.01),
        ("loss", -0.25),
        ("grad_norm", 0.5),
        ("kl", 0.01),
        ("trainer_step_s", 1.5),
        ("trainer_wait_s", 0.1),
        ("handoff_save_s", 0.2),
        ("handoff_load_s", 0.2),
        ("handoff_latency_s", 0.3),
        ("handoff_total_s", 0.4),
    ]  # figures the metrics line does not carry (not_carried, the memory) stay out


def _join(run_dir: Path) -> MetricsJoin:
    return MetricsJoin(
        run_dir, lambda step: {"reward_mean": step / 10}, lambda: {"trainer_restarts": 1}
    )


def _append(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(text)


def test_a_step_is_written_once_the_servers_hold_its_weights(tmp_path: Path) -> None:
    paths = RunDir(tmp_path)
    join = _join(tmp_path)
    _append(paths.trainer_metrics, rl_record(1).to_json() + "\n" + rl_record(2).to_json() + "\n")
    _append(paths.trainer_metrics, rl_record(3).to_json())  # no newline yet: not read
    assert join.poll(version=0, handoff={}) == []  # v1 not loaded: step 1 waits
    written = join.poll(version=1, handoff={1: HANDOFF})
    assert [m["step"] for m in written] == [1]
    assert written[0]["reward_mean"] == 0.1 and written[0]["handoff_load_s"] == 0.2
    assert written[0]["trainer_restarts"] == 1
    _append(paths.trainer_metrics, "\n")
    # v2 skipped (v3 landed first): steps 2 and 3 complete, 2 without load figures
    written = join.poll(version=3, handoff={1: HANDOFF})
    assert [m["step"] for m in written] == [2, 3] and "handoff_load_s" not in written[0]
    lines = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3] and steps_in(paths.metrics) == {1, 2, 3}


def test_a_restarted_controller_does_not_write_a_step_twice(tmp_path: Path) -> None:
    paths = RunDir(tmp_path)
    _append(paths.trainer_metrics, rl_record(1).to_json() + "\n" + rl_record(2).to_json() + "\n")
    assert [m["step"] for m in _join(tmp_path).poll(version=1, handoff={})] == [1]
    again = _join(tmp_path)  # a new controller reads the whole file from the start
    assert [m["step"] for m in again.poll(version=2, handoff={})] == [2]
    assert [json.loads(line)["step"] for line in paths.metrics.read_text().splitlines()] == [1, 2]


def test_a_supervised_line_carries_the_supervised_figures() -> None:
    record = TrainerStep(
        step=4,
        train_s=0.5,
        figures={"loss": 2.0, "eval_loss": 2.5, "lr": 1e-4, "clip_frac": 0.1},
        peak_rss_mb=800.0,
        state_mb=10.0,
    )
    line = supervised_metrics(TrainerStep.from_json(record.to_json()))
    assert isinstance(line.pop("time"), float)
    assert list(line.items()) == [
        ("step", 4),
        ("loss", 2.0),
        ("eval_loss", 2.5),
        ("lr", 1e-4),
        ("peak_rss_mb", 800.0),
        ("state_mb", 10.0),
        ("trainer_step_s", 0.5),
    ]  # clip_frac is an RL figure
