"""What every child process of a run does the same way to end with its parent."""

from __future__ import annotations

import os
import signal
import sys
import threading


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` (SIGKILL) to this process when its parent dies (even by
    kill -9).

    Used as the children's preexec_fn and by each trainer rank for itself, so a killed
    controller leaves no orphan that would hold ports or keep training. No-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, sig)
    except OSError:
        pass


def spawner_pid() -> int:
    """The pid a worker should die with (`die_with`), 0 for none: this process's, when it
    spawns from its main thread. Linux sends the parent-death signal when the thread that
    forked ends, so a worker started from another thread cannot ask for it."""
    return os.getpid() if threading.current_thread() is threading.main_thread() else 0


def die_with(parent_pid: int) -> None:
    """In a worker just started: be killed when `parent_pid` (its parent, from
    `spawner_pid`; 0: nothing) dies, even by kill -9, and exit now if it already has.
    A worker busy in user code (a hung reward, an agent) would otherwise outlive a killed
    controller, holding its terminal's output open."""
    if parent_pid <= 0:
        return
    die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the request was made
        os._exit(0)


def exit_without_teardown(code: int = 0) -> None:
    """Flush and end the process now, skipping process-group and interpreter teardown:
    gloo's background threads can abort a process there ("terminate called without an
    active exception"), turning a finished rank into a failed one. Call it only once
    every output is written and every rank has passed a final barrier."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
