"""The stop deadline (areal_cli.launch.stop_deadline): a stop that does not unwind in time
is named and forced; one that does, or was disarmed, is left alone. The end to end case (a
real controller stuck in a recipe's workflow) is in tests/e2e/test_stuck_stop.py."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_cli.launch.runs import _stop_wait_s
from areal_cli.launch.stop_deadline import StopDeadline, StopSignals


class Recorder:
    """The deadline's side effects, recorded instead of done (no process to kill here)."""

    def __init__(self) -> None:
        self.stopped = 0
        self.codes: list[int] = []
        self.done = threading.Event()

    def stop(self) -> None:
        self.stopped += 1

    def exit(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def _deadline(tmp_path: Path, rec: Recorder, limit_s: float) -> StopDeadline:
    return StopDeadline(
        rec.stop, tmp_path / "logs" / "controller.stop-stack", "areal train r.yaml --resume",
        limit_s, exit=rec.exit,
    )  # fmt: skip


def _stuck_in_cleanup(event: threading.Event) -> None:
    """The main thread's stand-in for an await that ignores cancellation."""
    event.wait(10)


def test_a_late_stop_names_where_the_main_thread_is_and_forces_the_exit(
    tmp_path: Path, capfd
) -> None:
    rec = Recorder()
    deadline = _deadline(tmp_path, rec, 0.2)
    deadline.arm()
    _stuck_in_cleanup(rec.done)  # the timer fires from its thread while we wait here
    assert rec.done.is_set() and rec.codes == [130] and rec.stopped == 1
    err = capfd.readouterr().err
    assert err.count("\n") == 1, err  # one line
    assert "error: the stop did not finish within 0.2 s; the controller was in " in err
    assert "test_stop_deadline.py:" in err and "in _stuck_in_cleanup" in err, err
    assert "every process of the run is killed" in err
    assert "continue it with: areal train r.yaml --resume" in err
    stacks = (tmp_path / "logs" / "controller.stop-stack").read_text()
    assert "--- thread MainThread ---" in stacks and "_stuck_in_cleanup" in stacks
    assert "--- thread areal-stop-deadline ---" in stacks
    assert not list((tmp_path / "logs").glob(".*.tmp"))  # renamed into place


def test_a_disarmed_deadline_never_fires(tmp_path: Path) -> None:
    rec = Recorder()
    deadline = _deadline(tmp_path, rec, 0.1)
    deadline.arm()
    deadline.disarm()
    time.sleep(0.4)
    assert rec.codes == [] and rec.stopped == 0
    deadline.fire("late")  # a timer that raced the disarm
    assert rec.codes == [] and not (tmp_path / "logs").exists()


def test_a_second_signal_forces_at_once_and_names_the_interrupted_frame(
    tmp_path: Path, capfd
) -> None:
    rec = Recorder()
    deadline = _deadline(tmp_path, rec, 600)
    deadline.arm()
    deadline.disarm()  # even once the launcher is stopping the children itself
    interrupted = sys._getframe()  # what a signal handler receives
    deadline.fire("again", frame=interrupted)
    deadline.fire("again", frame=interrupted)  # a third signal: nothing more
    assert rec.codes == [130] and rec.stopped == 1
    err = capfd.readouterr().err
    assert err.startswith("error: stopped at once by a second signal; the controller was in ")
    assert "in test_a_second_signal_forces_at_once" in err, err
    assert "launch/stop_deadline.py" not in err.split("(every")[0]  # not the handler's own frames


def test_the_stack_file_is_optional(tmp_path: Path, capfd) -> None:
    """A disk that refuses the stack file does not stop the forced exit."""
    rec = Recorder()
    blocker = tmp_path / "logs"
    blocker.write_text("a file where the folder should be")
    _deadline(tmp_path, rec, 600).fire("again", frame=sys._getframe())
    assert rec.codes == [130] and rec.stopped == 1
    assert "the controller was in " in capfd.readouterr().err


def test_areal_stop_waits_as_long_as_the_runs_controller_may_take(tmp_path: Path) -> None:
    assert _stop_wait_s(tmp_path) == 60.0  # no config.yaml: the default bound
    (tmp_path / "config.yaml").write_text("launcher:\n  stop_timeout_s: 120\n")
    assert _stop_wait_s(tmp_path) == 150.0
    (tmp_path / "config.yaml").write_text("launcher:\n  stop_timeout_s: 5\n")
    assert _stop_wait_s(tmp_path) == 60.0


def test_the_first_stop_signal_interrupts_and_a_second_forces(tmp_path: Path) -> None:
    rec = Recorder()
    stops = StopSignals(_deadline(tmp_path, rec, 600))
    before = signal.getsignal(signal.SIGTERM)
    stops.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here, in the main thread
        assert stops.name == "SIGTERM" and rec.codes == []
        os.kill(os.getpid(), signal.SIGINT)  # while stopping: no interrupt, the forced exit
        time.sleep(0.1)
        assert rec.codes == [130] and rec.stopped == 1
    finally:
        stops.restore()
    assert signal.getsignal(signal.SIGTERM) is before
