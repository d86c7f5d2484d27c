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


def test_a_step_that_lost_most_of_its_work_to_a_timeout_is_warned_once() -> None:
    from areal_cli.rollout.metrics import timeout_warnings

    warned: set[str] = set()
    half = {"step": 1, "agent_episodes": 64.0, "agent_timeouts": 32.0}
    assert timeout_warnings(half, warned) == []  # half is not most
    most = {"step": 2, "agent_episodes": 64.0, "agent_timeouts": 40.0, "online_sessions": 0.0}
    (line,) = timeout_warnings(most, warned)
    assert line.startswith("step 2: 40 of 64 agent episodes ran past rollout.agent_timeout_s")
    assert "rollout.max_concurrent_rollouts" in line
    assert timeout_warnings({**most, "step": 3}, warned) == []  # once per run
    online = {"step": 4, "online_sessions": 18.0, "online_timeouts": 10.0}
    (line,) = timeout_warnings(online, warned, {"rollout.session_timeout_s": 30.0})
    assert "10 of 18 online sessions ran past rollout.session_timeout_s (30 s)" in line
    assert timeout_warnings({"step": 5}, set()) == []  # no agents, no sessions


def test_the_metrics_task_says_the_warning_after_the_step(tmp_path: Path) -> None:
    import asyncio

    from areal_cli.rollout.metrics import metrics_task

    said: list[tuple[str, object]] = []

    class Recorder:  # a StepSink that keeps what it was told, in order
        def status(self, text: str) -> None:
            said.append(("status", text))

        def step(self, metrics: dict[str, float]) -> None:
            said.append(("step", metrics["step"]))

        def warn(self, text: str) -> None:
            said.append(("warn", text))

    paths = RunDir(tmp_path)
    paths.trainer_metrics.parent.mkdir(parents=True)
    lines = [rl_record(s).to_json() for s in (1, 2)]
    paths.trainer_metrics.write_text("".join(line + "\n" for line in lines))
    figures = {1: {"agent_episodes": 8.0, "agent_timeouts": 1.0}, 2: {"agent_episodes": 8.0, "agent_timeouts": 7.0}}  # fmt: skip
    join = MetricsJoin(tmp_path, lambda step: figures[step], dict)

    async def go() -> None:
        task = asyncio.ensure_future(
            metrics_task(join, lambda: 2, {}, Recorder(), {"rollout.agent_timeout_s": 0.5}, 0.01)
        )
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(go())
    assert [kind for kind, _ in said] == ["step", "step", "warn"]
    assert said[2][1].startswith(
        "step 2: 7 of 8 agent episodes ran past rollout.agent_timeout_s (0.5 s)"
    )
