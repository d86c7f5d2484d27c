"""Start, check and stop one inference server process (embedded or SGLang).

`server_argv` builds the command line from the same flag builders as the launch plan, so
`areal serve` and a training run start servers identically. `start_server` runs it in
its own process group with output to a log file and returns once the server is ready:
/health answers 200, then /model_info answers 200 (with the API key, so a wrong key shows
up here rather than on the first request). Any failure (the process exits, or the overall
timeout passes) stops the process and raises `ServerStartError` with the log path and the
log's last lines. `ServerProcess.stop` sends SIGTERM to the whole group, then SIGKILL
after a grace period, so no child outlives it.

Only the standard library is imported here: `areal serve` must start fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

BACKENDS = ("embedded", "sglang")
LOG_TAIL_LINES = 20
SGLANG_MISSING = "sglang is not installed; install with pip install -e '.[sglang]' on a GPU machine"


class ServerStartError(RuntimeError):
    """The server process exited or did not become ready in time."""


def server_argv(
    backend: str,
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str = "",
    dtype: str | None = None,
    tp: int = 1,
    python: str = sys.executable,
) -> list[str]:
    """The command line of one server, built by `plan.sglang_args` / `plan.embedded_args`
    from a default config with these settings; dtype None keeps the backend's default."""
    from areal_cli.config.allocation import parse_allocation
    from areal_cli.config.schema import DTYPES, ExperimentConfig
    from areal_cli.launch.plan import embedded_args, sglang_args

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    dtypes = DTYPES + ("auto",) if backend == "sglang" else DTYPES
    if dtype is not None and dtype not in dtypes:
        raise ValueError(f"--dtype for {backend} must be one of {', '.join(dtypes)}, got {dtype!r}")
    if tp < 1:
        raise ValueError("--tp must be at least 1")
    cfg = ExperimentConfig()
    cfg.inference.api_key = api_key
    if backend == "sglang":
        if dtype is not None:
            cfg.inference.sglang.dtype = dtype
        mode = parse_allocation(f"sglang:d1t{tp}")
        return [
            python,
            "-m",
            "sglang.launch_server",
            *sglang_args(cfg, mode, model, port, 0, host=host),
        ]
    if tp != 1:
        raise ValueError("the embedded backend runs on one device; use --tp 1")
    if dtype is not None:
        cfg.inference.embedded.dtype = dtype
    # "auto" lets the server pick CUDA when present, without importing torch here.
    args = embedded_args(cfg, model, port, 0, "auto", host=host)
    return [python, "-m", "areal_cli.inference.server", *args]


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ('' when it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class ServerProcess:
    """A started server: its process (leader of its own process group), URL and log."""

    proc: subprocess.Popen[bytes]
    url: str
    log: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit code."""
        pgid = self.proc.pid  # start_new_session made the server its group's leader
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            self.proc.wait()
        # The leader is gone; anything it left in the group must not outlive it.
        _signal_group(pgid, signal.SIGKILL)
        return self.proc.returncode

    def failure(self, what: str) -> ServerStartError:
        """An error that names the log and quotes its last lines."""
        tail = log_tail(self.log)
        quoted = "\n".join("  | " + line for line in tail.splitlines()) or "  | (empty)"
        return ServerStartError(f"{what}; log {self.log}, last lines:\n{quoted}")


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


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
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # its own process group, and no terminal Ctrl-C
        )
    server = ServerProcess(proc, url.rstrip("/"), str(log))
    try:
        wait_ready(server, api_key=api_key, timeout_s=timeout_s, poll_s=poll_s)
    except BaseException:
        server.stop(grace_s=5.0)
        raise
    return server


def wait_ready(
    server: ServerProcess, *, api_key: str = "", timeout_s: float = 300.0, poll_s: float = 0.25
) -> None:
    """Poll /health, then /model_info, within one overall deadline."""
    deadline = time.monotonic() + timeout_s
    for path in ("/health", "/model_info"):
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
