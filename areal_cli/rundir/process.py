"""What every child process of a run does the same way to end with its parent."""

from __future__ import annotations

import signal
import sys


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


def exit_without_teardown(code: int = 0) -> None:
    """Flush and end the process now, skipping process-group and interpreter teardown:
    gloo's background threads can abort a process there ("terminate called without an
    active exception"), turning a finished rank into a failed one. Call it only once
    every output is written and every rank has passed a final barrier."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
