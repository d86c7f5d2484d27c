"""A stop that was asked for (Ctrl-C, `areal stop`, a closed terminal) ends in bounded time.

The controller turns a stop signal into KeyboardInterrupt, which unwinds the rollout loop
(its tasks are cancelled, its pools and proxy closed) before every child is stopped. That
unwinding runs code from everywhere in the loop, so one await that ignores cancellation, or
a lock left held, would keep the run alive with nothing said. The deadline bounds it: armed
by the signal and disarmed once the interrupt reaches the launcher (whose own stop of the
children is bounded), it otherwise fires after `limit_s` (launcher.stop_timeout_s; a stop
unwinds in about a second) from a thread, which
- writes every thread's stack to RUN/logs/controller.stop-stack,
- says on stderr, in one line, where the controller was stuck,
- kills every process of the run and exits with 130 (the run resumes with --resume: each
  handoff file is renamed into place, so a killed writer leaves only temp files, swept at
  the next start).
A second stop signal during the stop fires it at once (the usual "press Ctrl-C again").

It writes with os.write, not through the display: the stuck main thread may hold the
console's lock.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType


class StopDeadline:
    """Force the controller's exit if a requested stop has not unwound within `limit_s`."""

    EXIT_CODE = 130  # interrupted, as a shell reports Ctrl-C (128 + SIGINT)

    def __init__(
        self,
        stop_children: Callable[[], None],
        stack_file: Path,
        resume_command: str,
        limit_s: float,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.stop_children = stop_children
        self.stack_file = stack_file
        self.resume_command = resume_command
        self.limit_s = limit_s
        self._exit = exit
        self._lock = threading.RLock()  # fire() may run in a signal handler while arm() holds it
        self._timer: threading.Timer | None = None
        self._disarmed = False  # the timer no longer fires
        self._fired = False

    def arm(self) -> None:
        """The stop began: fire in `limit_s` unless disarmed first."""
        with self._lock:
            if self._disarmed or self._timer is not None:
                return
            self._timer = threading.Timer(self.limit_s, self.fire, kwargs={"why": "late"})
            self._timer.daemon = True
            self._timer.name = "areal-stop-deadline"
            self._timer.start()

    def disarm(self) -> None:
        """The interrupt reached the launcher: what follows is bounded by itself."""
        with self._lock:
            self._disarmed = True
            if self._timer is not None:
                self._timer.cancel()

    def fire(self, why: str = "late", frame: FrameType | None = None) -> None:
        """Name where the main thread is, kill every child, exit 130. `why`: "late" (the
        timer, unless disarmed meanwhile) or "again" (a second stop signal: always).
        `frame`: where the main thread was, when this runs in it (a signal handler's)."""
        with self._lock:
            if self._fired or (why == "late" and self._disarmed):
                return
            self._fired = True
        where = self._write_stacks(frame)
        if why == "again":
            head = "stopped at once by a second signal"
        else:
            head = f"the stop did not finish within {self.limit_s:g} s"
        _say(
            f"error: {head}; the controller was in {where} "
            f"(every thread's stack: {self.stack_file}); every process of the run is killed; "
            f"continue it with: {self.resume_command}\n"
        )
        try:
            self.stop_children()
        finally:
            self._exit(self.EXIT_CODE)

    def _write_stacks(self, main_frame: FrameType | None) -> str:
        """Write every thread's stack to the stack file; returns where the main thread is:
        its innermost frame of areal's or the recipe's code as FILE:LINE in FUNCTION, and
        the innermost frame of all when that is in Python's or a package's code."""
        frames = sys._current_frames()
        main = threading.main_thread()
        parts, where = [], "an unknown place"
        for thread in threading.enumerate():
            frame = frames.get(thread.ident or -1)
            if thread is main and main_frame is not None:
                frame = main_frame  # not this handler's own frames
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)
            parts.append(f"--- thread {thread.name} ---\n" + "".join(stack.format()))
            if thread is main and stack:
                ours = [f for f in stack if _own(f.filename)] or list(stack)
                inner, last = ours[-1], stack[-1]
                where = f"{_short(inner.filename)}:{inner.lineno} in {inner.name}"
                if last is not inner:
                    where += f", inside {_short(last.filename)}:{last.lineno} in {last.name}"
        try:
            self.stack_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.stack_file.with_name(f".{self.stack_file.name}.tmp")
            tmp.write_text("\n".join(parts))
            os.replace(tmp, self.stack_file)
        except OSError:
            pass  # the line on stderr still says where
        return where


class StopSignals:
    """SIGINT (Ctrl-C), SIGTERM (`areal stop`) and SIGHUP (a closed terminal) ask the run
    to stop: the first raises KeyboardInterrupt in the main thread and arms the deadline;
    any later one fires the deadline at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, deadline: StopDeadline) -> None:
        self.deadline = deadline
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous = {}

    @property
    def name(self) -> str:
        """The first stop signal's name (SIGINT when none came: a KeyboardInterrupt)."""
        return signal.Signals(self.received or signal.SIGINT).name

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # a second stop signal while stopping: now
            self.deadline.fire(why="again", frame=frame)
            return
        self.received = signum
        self.deadline.arm()
        raise KeyboardInterrupt


@functools.cache
def _stdlib() -> str:
    """Python's own library folder."""
    return sysconfig.get_paths()["stdlib"]


def _own(filename: str) -> bool:
    """Whether a frame runs areal's code or a recipe's (not Python's or a package's)."""
    return not (filename.startswith((_stdlib(), "<")) or "-packages" in filename)


def _short(filename: str) -> str:
    """areal's and packages' sources from their package folder on (areal_cli/...,
    typer/...); Python's from its library folder (asyncio/...); a recipe's file whole."""
    parts = Path(filename).parts
    for anchor in ("areal_cli", "site-packages", "dist-packages"):
        if anchor in parts:
            i = parts.index(anchor)
            return "/".join(parts[i + (anchor != "areal_cli") :])
    own = not filename.startswith(_stdlib())
    return filename if own else os.path.relpath(filename, _stdlib())


def _say(text: str) -> None:
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass
