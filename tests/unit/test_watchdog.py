"""The progress watchdog's rules, heartbeat files and stack-dump parsing (no processes)."""

from __future__ import annotations

import faulthandler
import threading
from pathlib import Path

from areal_cli.config.schema import ExperimentConfig
from areal_cli.launch.watchdog import (
    ProgressWatchdog,
    ServerActivity,
    explain_trainer,
    main_thread_frames,
)
from areal_cli.rundir import heartbeat
from areal_cli.rundir.heartbeat import Beat, Heartbeat


def _cfg(**watchdog) -> ExperimentConfig:
    cfg = ExperimentConfig()
    cfg.launcher.startup_timeout_s = 300.0
    for key, value in watchdog.items():
        setattr(cfg.launcher.watchdog, key, value)
    return cfg


def _beat(
    rank: int, phase: str, since: float, steps: int = 0, seq: int = 1, step_s: float = 0.0
) -> Beat:
    return Beat(f"trainer-{rank}", 1000 + rank, phase, since, seq, steps, since, step_s)


def _beats(*beats: Beat) -> dict[str, Beat]:
    return {b.name: b for b in beats}


def _finish_steps(dog: ProgressWatchdog, times: list[float]) -> None:
    """The trainer appears, then finishes one step at each of `times` (rank 1 is slower
    by 10%, as it reports)."""
    dog.observe(_beats(_beat(0, "build model", 0.0), _beat(1, "build model", 0.0)), 0.0)
    previous = 0.0
    for i, t in enumerate(times):
        took = t - previous
        beats = [
            _beat(r, "wait for rollouts/step-x", t, i + 1, step_s=took * (1 + r / 10))
            for r in (0, 1)
        ]
        dog.observe(_beats(*beats), t)
        previous = t


def test_the_limit_covers_startup_then_follows_step_times() -> None:
    dog = ProgressWatchdog(_cfg(min_timeout_s=120.0, step_time_factor=10.0), start=0.0)
    assert dog.limit() == 300.0  # no step yet: at least the startup timeout
    _finish_steps(dog, [1.0, 2.0, 3.0, 4.0])  # steps of 1 s (1.1 s on the slower rank)
    assert dog.limit() == 120.0  # 10 x 1.1 s is below the floor
    fixed = ProgressWatchdog(_cfg(timeout_s=15.0), start=0.0)
    assert fixed.limit() == 300.0
    _finish_steps(fixed, [5.0, 6.0])
    assert fixed.limit() == 15.0


def test_slow_steps_raise_the_limit() -> None:
    dog = ProgressWatchdog(_cfg(min_timeout_s=60.0, step_time_factor=10.0), start=0.0)
    _finish_steps(dog, [20.0, 40.0, 60.0])  # 20 s steps, 22 s on the slower rank
    assert dog.limit() == 220.0


def test_a_watchdog_that_polls_slowly_still_learns_the_step_time() -> None:
    dog = ProgressWatchdog(_cfg(timeout_s=15.0), start=0.0)
    # first sight of the trainer after it already finished two steps of 0.5 s
    dog.observe(_beats(_beat(0, "step 2: train mb 1/1", 9.0, steps=2, step_s=0.5)), 9.5)
    assert dog.limit() == 15.0


def test_a_rank_stuck_in_a_phase_is_named() -> None:
    dog = ProgressWatchdog(_cfg(timeout_s=10.0), start=0.0)
    _finish_steps(dog, [1.0, 2.0])
    beats = _beats(
        _beat(0, "step 2: train mb 1/2", 3.0, 1), _beat(1, "step 2: train mb 1/2", 3.0, 1)
    )
    assert dog.check(beats, [], now=12.0) is None
    stuck = dog.check(beats, [], now=14.0)
    assert stuck is not None and stuck.side == "trainer"
    assert "no progress for 11 s (limit 10 s)" in stuck.message
    assert "rank 1 in 'step 2: train mb 1/2' for 11 s" in stuck.message


def test_a_trainer_waiting_for_rollouts_is_not_stuck_while_servers_finish_requests() -> None:
    dog = ProgressWatchdog(_cfg(timeout_s=10.0), start=0.0)
    _finish_steps(dog, [1.0, 2.0])
    beats = _beats(_beat(0, "wait for rollouts/step-2", 2.0, 2))
    busy = [ServerActivity("server-0", {"/generate": 8}, last_done=25.0)]
    assert dog.check(beats, busy, now=30.0) is None


def test_a_server_that_holds_requests_without_finishing_any_is_named() -> None:
    dog = ProgressWatchdog(_cfg(timeout_s=10.0), start=0.0)
    _finish_steps(dog, [1.0, 2.0])
    beats = _beats(_beat(0, "wait for rollouts/step-2", 2.0, 2))
    servers = [
        ServerActivity("server-0", {}, last_done=1.5),
        ServerActivity("server-1", {"/generate": 5, "/update_weights_from_disk": 1}, 1.8),
    ]
    stuck = dog.check(beats, servers, now=20.0)
    assert stuck is not None and stuck.side == "rollout"
    assert (
        "server-1 holds 5 /generate and 1 /update_weights_from_disk call(s) and answered none"
        in stuck.message
    )
    assert "server-0" not in stuck.message
    assert "the trainer waits in 'wait for rollouts/step-2'" in stuck.message


def test_an_idle_rollout_loop_and_a_silent_trainer_are_named() -> None:
    dog = ProgressWatchdog(_cfg(timeout_s=10.0), start=0.0)
    _finish_steps(dog, [1.0, 2.0])
    idle = [ServerActivity("server-0", {}, last_done=1.0)]
    beats = _beats(_beat(0, "wait for rollouts/step-2", 2.0, 2))
    stuck = dog.check(beats, idle, now=20.0)
    assert stuck is not None and "the controller sent no request" in stuck.message
    silent = ProgressWatchdog(_cfg(timeout_s=10.0), start=0.0)
    stuck = silent.check({}, idle, now=310.0)  # startup limit: 300 s
    assert stuck is not None and "the trainer reported nothing for 310 s" in stuck.message


def test_heartbeat_files_round_trip(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(heartbeat.FAULT_ENV, "trainer-3:never")
    beat = Heartbeat(tmp_path, "trainer-1")
    beat.phase("build model")
    beat.steps_done = 4
    beat.phase("step 4: train mb 1/2")
    Heartbeat(tmp_path, "server-0").phase("serving")
    (tmp_path / "heartbeat" / "trainer-9.json").write_text("{not json")  # torn or foreign
    found = heartbeat.read_all(tmp_path, "trainer-")
    assert list(found) == ["trainer-1"]
    got = found["trainer-1"]
    assert (got.phase, got.seq, got.steps_done) == ("step 4: train mb 1/2", 2, 4)
    assert not [p for p in (tmp_path / "heartbeat").iterdir() if p.name.startswith(".")]
    heartbeat.clear(tmp_path)
    assert heartbeat.read_all(tmp_path) == {}


def _real_dump(tmp_path: Path) -> str:
    """A faulthandler dump of this process with a second thread, as SIGUSR1 writes it."""
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    worker.start()
    path = tmp_path / "dump.txt"
    with open(path, "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    stop.set()
    return path.read_text()


def test_stacks_tell_the_stuck_rank_from_the_ranks_that_wait(tmp_path: Path) -> None:
    dump = _real_dump(tmp_path)
    frames = main_thread_frames(dump)
    assert frames and frames[0][2] == "_real_dump"  # innermost first, main thread chosen
    waiting = (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n'
        "\n"
        "Current thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/v/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 290 in foreach_all_gather\n'
        '  File "/v/site-packages/torch/nn/modules/module.py", line 1770 in _call_impl\n'
        '  File "/work/areal_cli/trainer/main.py", line 309 in <module>\n'
    )
    ranks = (_beat(0, "step 2: train mb 1/2", 0.0), _beat(1, "step 2: train mb 1/2", 0.0))
    text = explain_trainer(ranks, {"trainer-0": waiting, "trainer-1": dump}, now=20.0)
    assert text.startswith("rank 1 is stuck outside any collective in 'step 2: train mb 1/2'")
    assert "test_watchdog.py" in text
    assert "rank 0 waits for it in a collective" in text
    both = explain_trainer(ranks, {"trainer-0": waiting, "trainer-1": waiting}, now=20.0)
    assert "do not match" in both
    assert explain_trainer(ranks, {"trainer-0": waiting}, now=20.0) == ""  # a dump missing
