"""`areal serve` as a user runs it, and the launcher underneath (start, readiness, stop)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from areal_cli.inference.backends import BACKENDS, ServeOptions
from areal_cli.inference.backends.sglang import SGLANG_MISSING
from areal_cli.launch.local import ServerStartError, start_server
from tests.conftest import REPO, free_port, run_areal

GREEDY = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def get(url: str, body: dict | None = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, None


def wait_for_ready(proc: subprocess.Popen, stderr: Path, timeout: float = 120) -> None:
    """Wait for the `ready:` line: only then does Ctrl-C count as stopping a live server."""
    deadline = time.monotonic() + timeout
    while "ready: " not in stderr.read_text():
        assert proc.poll() is None, stderr.read_text()
        assert time.monotonic() < deadline, "areal serve did not become ready"
        time.sleep(0.2)


# --------------------------------------------------------------------------- areal serve


@pytest.mark.slow
def test_serve_answers_then_stops_cleanly_on_ctrl_c(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log, err = tmp_path / "serve.log", tmp_path / "serve.err"
    cmd = [sys.executable, "-m", "areal_cli.cli", "serve", str(tiny_model_dir), "--port", str(port)]
    with open(err, "w") as stderr_file:
        proc = subprocess.Popen([*cmd, "--log", str(log)], cwd=REPO, stderr=stderr_file)
    try:
        wait_for_ready(proc, err)
        status, out = get(url + "/generate", {"input_ids": [5, 6], "sampling_params": GREEDY})
        assert status == 200 and len(out["output_ids"]) == 3
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = err.read_text()
    assert proc.returncode == 130, stderr  # interrupted, as the README's exit codes say
    assert f"ready: {url}" in stderr and "stopping the server" in stderr
    assert "Traceback" not in stderr
    assert port_is_free(port)
    assert "serving" in log.read_text()


def test_missing_model_exits_2_with_one_line(tmp_path: Path) -> None:
    result = run_areal("serve", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nope'} does not exist; give an HF folder (config.json and "
        "*.safetensors), a LoRA adapter folder, a run directory (its newest weights/vN), "
        "RUN/weights/vN, "
        "RUN/checkpoints/step-N or RUN/recover/step-N, or builtin:tiny-arith"
    ]


def test_every_checkpoint_kind_is_served_or_refused_in_one_line(tmp_path: Path) -> None:
    """serve takes what eval and convert-checkpoint take (areal_cli.rundir.checkpoints);
    a run directory without weights, a DCP entry and a stray folder get one line each."""
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    for name in ("config.yaml", "plan.json"):
        (run / name).write_text("{}")
    (run / "recover" / "step-3" / "dcp").mkdir(parents=True)
    (run / "recover" / "step-3" / "dcp" / ".metadata").write_bytes(b"")
    (tmp_path / "stray").mkdir()
    cases = {
        run: "has no finished weights/vN yet",
        run
        / "recover"
        / "step-3": "is a DCP checkpoint and serve serves HF folders; convert it first",
        tmp_path / "stray": "is not a checkpoint; give an HF folder",
    }
    for path, said in cases.items():
        result = run_areal("serve", str(path))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and said in lines[0], result.stderr
        assert "Traceback" not in result.stderr


def test_unknown_builtin_and_backend_exit_2(tmp_path: Path) -> None:
    result = run_areal("serve", "builtin:huge", "--model-cache", str(tmp_path))
    model = tmp_path / "m"  # passes for an HF folder; the options are what is wrong
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    assert result.returncode == 2 and "unknown builtin model 'builtin:huge'" in result.stderr
    result = run_areal("serve", str(model), "--backend", "vlm")
    assert result.returncode == 2 and "--backend must be one of embedded, sglang" in result.stderr
    result = run_areal("serve", str(model), "--backend", "vllm", "--python", str(tmp_path))
    assert result.returncode == 2 and "cannot import vllm with" in result.stderr
    result = run_areal("serve", str(model), "--dtype", "auto")
    assert result.returncode == 2 and "--dtype for embedded must be one of" in result.stderr


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_sglang_backend_without_sglang_exits_2(tmp_path: Path) -> None:
    result = run_areal("serve", str(tmp_path), "--backend", "sglang")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {SGLANG_MISSING}"


def test_serve_is_listed_in_help() -> None:
    assert "serve" in run_areal("--help").stdout
    options = run_areal("serve", "--help").stdout
    for option in ("--backend", "--host", "--port", "--api-key", "--dtype", "--tp", "MODEL"):
        assert option in options


# --------------------------------------------------------------------------- launcher


def test_server_argv_builds_real_flags() -> None:
    options = ServeOptions("/m", host="0.0.0.0", port=31000, api_key="k", dtype="float16", tp=2)
    argv = BACKENDS["sglang"].serve_argv(options, "py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--model-path"] == "/m" and flags["--host"] == "0.0.0.0"
    assert flags["--port"] == "31000" and flags["--tp-size"] == "2"
    assert flags["--dtype"] == "float16" and flags["--api-key"] == "k"
    argv = BACKENDS["embedded"].serve_argv(ServeOptions("/m", port=31001), "py")
    assert argv[:3] == ["py", "-m", "areal_cli.inference.server"]
    assert argv[argv.index("--port") + 1] == "31001" and "--api-key" not in argv
    assert argv[argv.index("--dtype") + 1] == "float32"
    with pytest.raises(ValueError, match="one device"):
        BACKENDS["embedded"].serve_argv(ServeOptions("/m", tp=2), "py")


@pytest.mark.parametrize(
    "backend, running, context",
    [
        ("embedded", "--max-running-requests", "--context-length"),
        ("sglang", "--max-running-requests", "--context-length"),
        ("vllm", "--max-num-seqs", "--max-model-len"),
    ],
)
def test_serve_limits_reach_each_backend_under_its_own_name(
    backend: str, running: str, context: str
) -> None:
    argv = BACKENDS[backend].serve_argv(
        ServeOptions("/m", max_running_requests=5, context_length=512), "py"
    )
    assert argv[argv.index(running) + 1] == "5" and argv[argv.index(context) + 1] == "512"
    plain = BACKENDS[backend].serve_argv(ServeOptions("/m"), "py")
    assert context not in plain


def test_start_failure_quotes_the_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "print('model is broken'); raise SystemExit(3)"]
    with pytest.raises(ServerStartError) as err:
        start_server(argv, tmp_path / "s.log", f"http://127.0.0.1:{free_port()}", timeout_s=30)
    message = str(err.value)
    assert "exited with code 3 while starting" in message
    assert str(tmp_path / "s.log") in message and "  | model is broken" in message


@pytest.mark.slow
def test_start_timeout_stops_the_whole_process_group(tmp_path: Path) -> None:
    # The "server" starts a grandchild and never listens; both must be gone afterwards.
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        "print('loading forever', flush=True)\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    with pytest.raises(ServerStartError, match="not ready after 2s") as err:
        start_server(
            [sys.executable, "-c", code],
            tmp_path / "s.log",
            f"http://127.0.0.1:{free_port()}",
            timeout_s=2,
        )
    assert time.monotonic() - start < 20
    assert "loading forever" in str(err.value)
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the grandchild outlived the stop"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent was killed; init reaps it later).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_wrong_api_key_fails_fast(tmp_path: Path) -> None:
    # A stand-in server: /health is open, every other route wants another key.
    port = free_port()
    code = (
        "from http.server import BaseHTTPRequestHandler, HTTPServer\n"
        "class H(BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if self.path == '/health' else 401)\n"
        "        self.end_headers()\n"
        f"HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    start = time.monotonic()
    with pytest.raises(ServerStartError, match="refused the API key on /v1/models"):
        start_server(
            [sys.executable, "-c", code],
            tmp_path / "s.log",
            f"http://127.0.0.1:{port}",
            api_key="wrong",
            timeout_s=60,
        )
    assert time.monotonic() - start < 30
    assert port_is_free(port)
