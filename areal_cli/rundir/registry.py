"""The server registry: RUN/registry/<name>.json says where each inference server runs.

A server started by a cluster launcher (Slurm) may run on any node of the job, so the
controller does not assume an address: each server's job step records its host, port,
pid, node and Slurm job/step ids (`register`, run by areal_cli.launch.step right before it
becomes the server) and the controller waits for those files (`wait_for`). Each file is
written to a temp name and renamed into place. A restarted server writes its file again.
The local launcher knows its servers listen on 127.0.0.1 and does not use the registry.

Only the standard library (and handoff, which uses only it) is imported here: the step
wrapper must start fast.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from areal_cli.rundir.handoff import write_json_atomic

REGISTRY_DIR = "registry"
HOST_ENV = "AREAL_REGISTER_HOST"  # the address to record, when the launcher knows it (Ray)


def entry_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / REGISTRY_DIR / f"{name}.json"


def register(path: Path, name: str, port: int) -> dict:
    """Record that server `name` runs here on `port` (this process's pid); the host is
    $AREAL_REGISTER_HOST when the launcher set it, else this machine's hostname."""
    entry = {
        "name": name,
        "host": os.environ.get(HOST_ENV) or socket.gethostname(),
        "port": port,
        "pid": os.getpid(),
        "node": os.environ.get("SLURMD_NODENAME", ""),
        "job_id": os.environ.get("SLURM_JOB_ID", ""),
        "step_id": os.environ.get("SLURM_STEP_ID", ""),
        "time": time.time(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, entry)
    return entry


def read(run_dir: Path, name: str) -> dict | None:
    try:
        return json.loads(entry_path(run_dir, name).read_text())
    except (OSError, ValueError):
        return None


def clear(run_dir: Path) -> None:
    """Forget an earlier attempt's entries (their servers are gone)."""
    for path in (Path(run_dir) / REGISTRY_DIR).glob("*.json"):
        path.unlink(missing_ok=True)


def url(entry: dict) -> str:
    return f"http://{entry['host']}:{entry['port']}"


def wait_for(
    run_dir: Path,
    names: list[str],
    timeout_s: float,
    check: Callable[[], None] = lambda: None,
    poll_s: float = 0.2,
) -> dict[str, dict]:
    """Each named server's entry, once all are written; `check` raises when a process
    died meanwhile. TimeoutError names the servers that never registered."""
    deadline = time.monotonic() + timeout_s
    found: dict[str, dict] = {}
    while True:
        for name in names:
            if name not in found and (entry := read(run_dir, name)) is not None:
                found[name] = entry
        if len(found) == len(names):
            return found
        check()
        if time.monotonic() > deadline:
            missing = ", ".join(n for n in names if n not in found)
            raise TimeoutError(
                f"{missing} did not register in {Path(run_dir) / REGISTRY_DIR} within {timeout_s:g}s"
            )
        time.sleep(poll_s)
