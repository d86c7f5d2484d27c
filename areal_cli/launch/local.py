"""The local runner: starts a plan's processes on this machine and stops them all.

Each child runs in its own session (process group), with stdout and stderr appended to
its log file, its environment from the plan, and its CPU affinity set right after spawn
(before torchrun or the server start threads, so their children inherit it). `stop_all`
sends SIGTERM to every group, waits, then SIGKILLs what is left, so no descendant (a
torchrun rank, a server's worker) outlives the controller.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from areal_cli.launch.plan import ProcessSpec


@dataclass
class Child:
    """A started process and the spec it came from."""

    spec: ProcessSpec
    popen: subprocess.Popen


class ChildFailed(RuntimeError):
    """A child exited while the run still needed it."""

    def __init__(self, child: Child, returncode: int, tail: str):
        self.child, self.returncode, self.tail = child, returncode, tail
        super().__init__(f"{child.spec.name} exited with code {returncode}; log: {child.spec.log}")


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (even by kill -9).

    Used as the children's preexec_fn and by each trainer rank for itself, so a killed
    controller leaves no orphan that would hold ports or keep training. No-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass


def tail_lines(path: str | Path, n: int = 20) -> str:
    """The last `n` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError:
        return ""


class LocalRunner:
    """Start, watch and stop the processes of a plan."""

    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, spec: ProcessSpec, argv: list[str] | None = None) -> Child:
        """Start one process (argv overrides the spec's, e.g. to restore a secret)."""
        Path(spec.log).parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **spec.env}
        with open(spec.log, "ab") as log:
            popen = subprocess.Popen(
                argv or spec.argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        if spec.cpus and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(popen.pid, spec.cpus)
            except OSError:
                pass  # fewer cores than planned (a dry-run plan on another machine); run unpinned
        child = Child(spec, popen)
        self.children.append(child)
        return child

    def check(self, allow_exit: set[str] = frozenset()) -> None:
        """Raise ChildFailed if a child died (or exited at all, unless allowed to)."""
        for child in self.children:
            code = child.popen.poll()
            if code is None:
                continue
            if code == 0 and child.spec.name in allow_exit:
                continue
            raise ChildFailed(child, code, tail_lines(child.spec.log))

    def get(self, name: str) -> Child:
        return next(c for c in self.children if c.spec.name == name)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, wait up to `grace_s`, then SIGKILL the rest."""
        for child in self.children:
            _signal_group(child.popen, signal.SIGTERM)
            _signal_group(
                child.popen, signal.SIGCONT
            )  # a stopped process acts on TERM only once continued
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for child in self.children:
            _signal_group(child.popen, signal.SIGKILL)  # also reaps grandchildren left behind
            try:
                child.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
