"""Heartbeats: what each process of a run is doing now, in RUN/heartbeat/<name>.json.

Writer (one per file, e.g. trainer rank r writes `trainer-r.json`): `Heartbeat.phase(text)`
is called as each phase starts ("step 3: train mb 2/4", "step 3: publish v4"). It writes
the whole state to a temp file beside the target and renames it into place, so a reader
sees the previous state or the new one, never half of one. There is no fsync: a
heartbeat describes a live process and means nothing after a crash of the machine.

Each state holds the process's pid, the phase, `since` (wall time the phase started),
`seq` (phases entered so far; it only grows), `steps_done`, `step_s` (how long the
last finished step took, waiting for its input included; 0 before the first) and
`holds_devices` (a colocated trainer rank says False once it has given the devices to
the servers: areal_cli.rollout.phases waits for that). A process stuck inside a
phase stops updating its file, so `now - since` is how long it has been stuck there.

Stack dumps: `Heartbeat.enable_stack_dump()` makes SIGUSR1 write every thread's Python
stack to RUN/heartbeat/<name>.stack (faulthandler, which works while the main thread is
blocked in C code such as a collective). The controller's watchdog uses it to tell a
rank that waits in a collective from the rank it waits for.

Fault injection (tests only): with AREAL_FAULT_HANG="NAME:TEXT", the process whose
heartbeat is NAME sleeps forever once it enters a phase containing TEXT, after
recording that phase. It stands in for a rank that stops inside a step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

HEARTBEAT_DIR = "heartbeat"
FAULT_ENV = "AREAL_FAULT_HANG"


@dataclass(frozen=True)
class Beat:
    """One process's last reported state."""

    name: str
    pid: int
    phase: str
    since: float
    seq: int
    steps_done: int
    time: float
    step_s: float = 0.0
    holds_devices: bool = True  # a colocated trainer: False while the servers may use them


class Heartbeat:
    """The writer side: one process's heartbeat file."""

    def __init__(self, run_dir: Path, name: str) -> None:
        self.dir = Path(run_dir) / HEARTBEAT_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.path = self.dir / f"{name}.json"
        self._tmp = self.dir / f".{name}.json.tmp"
        self.seq = 0
        self.steps_done = 0
        self.step_s = 0.0
        self.holds_devices = True  # written with each phase (colocated runs read it)
        self.last_phase = ""
        self._stack_file: IO[str] | None = None
        fault = os.environ.get(FAULT_ENV, "")
        target, _, text = fault.partition(":")
        self._hang_on = text if fault and target == name else ""

    def phase(self, text: str) -> None:
        """Record that the process now starts `text`."""
        self.seq += 1
        self.last_phase = text
        now = time.time()
        state = {
            "name": self.name,
            "pid": os.getpid(),
            "phase": text,
            "since": now,
            "seq": self.seq,
            "steps_done": self.steps_done,
            "step_s": self.step_s,
            "time": now,
            "holds_devices": self.holds_devices,
        }
        with open(self._tmp, "w") as f:
            f.write(json.dumps(state))
        os.replace(self._tmp, self.path)
        if self._hang_on and self._hang_on in text:
            _hang_forever()

    def enable_stack_dump(self) -> None:
        """SIGUSR1 writes every thread's stack to RUN/heartbeat/NAME.stack."""
        import faulthandler
        import signal

        self._stack_file = open(
            self.dir / f"{self.name}.stack", "w"
        )  # open for the life of the process
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)


def _hang_forever() -> None:
    while True:
        time.sleep(3600)


def read_all(run_dir: Path, prefix: str = "") -> dict[str, Beat]:
    """Every heartbeat under RUN/heartbeat whose name starts with `prefix`, by name."""
    directory = Path(run_dir) / HEARTBEAT_DIR
    beats: dict[str, Beat] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return beats
    for file in names:
        if file.startswith(".") or not file.endswith(".json") or not file.startswith(prefix):
            continue
        try:
            data = json.loads((directory / file).read_text())
            beats[data["name"]] = Beat(
                **{k: data[k] for k in Beat.__dataclass_fields__ if k in data}
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # replaced between listdir and read, or not ours
    return beats


def stack_file(run_dir: Path, name: str) -> Path:
    """Where process NAME dumps its stacks on SIGUSR1."""
    return Path(run_dir) / HEARTBEAT_DIR / f"{name}.stack"


def clear(run_dir: Path) -> None:
    """Forget the heartbeats of an earlier attempt (a resumed run starts afresh)."""
    directory = Path(run_dir) / HEARTBEAT_DIR
    if directory.is_dir():
        for file in os.listdir(directory):
            try:
                os.unlink(directory / file)
            except OSError:
                pass
