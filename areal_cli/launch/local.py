"""The local runner: starts processes on this machine, watches them and stops them all.

Every process that areal starts on this machine goes through `LocalRunner`: the servers
and the trainer of `areal train` (a plan's processes), the servers of `areal eval`, and
the one server of `areal serve` (`start_server`). Each child runs in its own session
(process group), with stdout and stderr appended to its log file, its environment from
its spec, its CPU affinity set right after spawn (before torchrun or the server start
threads, so their children inherit it), and SIGKILL asked for when its parent dies
(when started from the main thread; see `start`).
`stop_all` sends SIGTERM to every group, waits, then SIGKILLs what is left, so no
descendant (a torchrun rank, a server's worker) outlives the controller. A child that
fails is reported with its log's last lines (`log_tail`).

Only the standard library and areal's config-level modules are imported here:
`areal serve` must start fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from areal_cli.launch.plan import ProcessSpec
from areal_cli.rundir.process import die_with_parent

LOG_TAIL_LINES = 20


@dataclass
class Child:
    """A started process, the spec it came from and the command line it was started
    with (before a cluster runner wrapped it: what a restart starts again)."""

    spec: ProcessSpec
    popen: subprocess.Popen
    argv: list[str] = field(default_factory=list)


class ChildFailed(RuntimeError):
    """A child exited while the run still needed it."""

    def __init__(self, child: Child, returncode: int, tail: str):
        self.child, self.returncode, self.tail = child, returncode, tail
        super().__init__(f"{child.spec.name} exited with code {returncode}; log: {child.spec.log}")


class ProcessCancelled(Exception):
    """A cluster ended one of the run's processes on purpose (Slurm: scancel of a step):
    the run stops as on Ctrl-C instead of restarting it."""


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ('' when it is missing); reads at most 64 KiB."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class LocalRunner:
    """Start, watch and stop a set of processes."""

    pin_cpus = True  # set each child's CPU affinity from its spec

    def __init__(self) -> None:
        self.children: list[Child] = []

    def command(self, spec: ProcessSpec, argv: list[str]) -> list[str]:
        """The command line that starts `spec` (a cluster runner wraps it in a job step)."""
        return argv

    def start(self, spec: ProcessSpec, argv: list[str] | None = None) -> Child:
        """Start one process (argv overrides the spec's, e.g. to restore a secret)."""
        Path(spec.log).parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **spec.env}
        # Linux ties the parent-death signal to the thread that forks, not the process: a
        # child started from a worker thread would be killed when that thread ends. So it
        # is asked for only from the main thread; elsewhere stop_all is the only cleanup.
        on_main = threading.current_thread() is threading.main_thread()
        with open(spec.log, "ab") as log:
            popen = subprocess.Popen(
                self.command(spec, argv or spec.argv),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, and no terminal Ctrl-C
                preexec_fn=die_with_parent if on_main else None,
            )
        if self.pin_cpus and spec.cpus and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(popen.pid, spec.cpus)
            except OSError:
                pass  # fewer cores than planned (a dry-run plan on another machine); run unpinned
        child = Child(spec, popen, list(argv or spec.argv))
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
            raise ChildFailed(child, code, log_tail(child.spec.log))

    def pids(self) -> dict[str, int]:
        """Each child's name and pid."""
        return {c.spec.name: c.popen.pid for c in self.children}

    def get(self, name: str) -> Child:
        return next(c for c in self.children if c.spec.name == name)

    def stop(self, child: Child, grace_s: float = 10.0) -> None:
        """Stop `child`'s whole process group (nothing of it survives) and forget it; its
        spec can then be started again (appending to the same log)."""
        _stop_groups([child], grace_s)
        self.children.remove(child)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, wait up to `grace_s`, then SIGKILL the rest."""
        _stop_groups(self.children, grace_s)


def _stop_groups(children: list[Child], grace_s: float) -> None:
    for child in children:
        signal_group(child.popen, signal.SIGTERM)
        signal_group(child.popen, signal.SIGCONT)  # a stopped process acts on TERM once continued
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        signal_group(child.popen, signal.SIGKILL)  # also reaps grandchildren left behind
        try:
            child.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process group that `popen` leads (nothing if it is empty)."""
    try:
        os.killpg(popen.pid, sig)  # start_new_session made it its group's leader
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


# ------------------------------------------------------------------ one HTTP server


class ServerStartError(RuntimeError):
    """The server process exited or did not become ready in time."""


@dataclass
class ServerProcess:
    """One started server (`areal serve`, tests, benchmarks): its runner, URL and log."""

    url: str
    child: Child
    runner: LocalRunner = field(repr=False)

    @property
    def proc(self) -> subprocess.Popen:
        return self.child.popen

    @property
    def pid(self) -> int:
        return self.child.popen.pid

    @property
    def log(self) -> str:
        return self.child.spec.log

    def alive(self) -> bool:
        return self.child.popen.poll() is None

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit code."""
        self.runner.stop_all(grace_s)
        return self.child.popen.returncode

    def failure(self, what: str) -> ServerStartError:
        """An error that names the log and quotes its last lines."""
        quoted = "\n".join("  | " + line for line in log_tail(self.log).splitlines())
        return ServerStartError(f"{what}; log {self.log}, last lines:\n{quoted or '  | (empty)'}")


def start_server(
    argv: list[str],
    log: str | Path,
    url: str,
    *,
    api_key: str = "",
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    poll_s: float = 0.25,
) -> ServerProcess:
    """Start `argv` with output to `log` (appended), wait until it is ready at `url`, and
    return it; on failure stop it and raise `ServerStartError`."""
    runner = LocalRunner()
    spec = ProcessSpec(
        name="server",
        role="inference",
        argv=list(argv),
        env={"PYTHONUNBUFFERED": "1", **(env or {})},
        log=str(log),
    )
    server = ServerProcess(url.rstrip("/"), runner.start(spec), runner)
    try:
        wait_ready(server, api_key=api_key, timeout_s=timeout_s, poll_s=poll_s)
    except BaseException:
        server.stop(grace_s=5.0)
        raise
    return server


def wait_ready(
    server: ServerProcess, *, api_key: str = "", timeout_s: float = 300.0, poll_s: float = 0.25
) -> None:
    """Poll /health, then /v1/models (with the API key, so a wrong key shows up here
    rather than on the first request; every backend has both), within one deadline."""
    deadline = time.monotonic() + timeout_s
    for path in ("/health", "/v1/models"):
        while (status := _status(server.url + path, api_key)) != 200:
            if status in (401, 403):
                raise server.failure(f"server {server.url} refused the API key on {path}")
            if not server.alive():
                raise server.failure(
                    f"server {server.url} exited with code {server.proc.returncode} while starting"
                )
            if time.monotonic() > deadline:
                raise server.failure(f"server {server.url} not ready after {timeout_s:g}s")
            time.sleep(poll_s)


def _status(url: str, api_key: str) -> int | None:
    """The HTTP status of a GET, or None when nothing answers."""
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError):
        return None
