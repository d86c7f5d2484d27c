"""Usage: python -m areal_cli.launch.ray_head [--remove DIR] -- ray start --head --block ...

The local Ray head of one areal run, and every Ray process with it. Ray's daemons share
this process's group, but when `ray start --block` is killed some of them (the dashboard
and runtime-env agents) stay up for a minute or more. This wrapper runs the command in
its group and, when the command ends, when it is sent SIGTERM, or when its parent (the
controller) dies, even by kill -9 (it asks for SIGTERM on parent death), it terminates
the whole group: SIGTERM, then SIGKILL after two seconds (the agents ignore SIGTERM).
Then it removes DIR (Ray's temp dir for this head).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from areal_cli.rundir.process import die_with_parent

GRACE_S = 2.0  # a run's own Ray keeps no state worth a longer wait


def _group_members() -> list[int]:
    """Other processes of this process group."""
    me, group = os.getpid(), os.getpgrp()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    remove = ""
    if command[:1] == ["--remove"] and len(command) > 1:
        remove, command = command[1], command[2:]
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        usage = "usage: python -m areal_cli.launch.ray_head [--remove DIR] -- COMMAND..."
        print(usage, file=sys.stderr)
        return 2
    stopping = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # the group this ends must be its own, never its caller's
    die_with_parent(signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before we asked
        stopping["signal"] = signal.SIGTERM
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    while not stopping["signal"] and child.poll() is None:
        time.sleep(0.2)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgrp(), signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while _group_members() and time.monotonic() < deadline:
        child.poll()  # reap it
        time.sleep(0.2)
    code = child.poll()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for pid in _group_members():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if remove:
        time.sleep(0.5)  # the killed processes close their files
        shutil.rmtree(remove, ignore_errors=True)
    return 0 if stopping["signal"] else (code or 0)


if __name__ == "__main__":
    raise SystemExit(main())
