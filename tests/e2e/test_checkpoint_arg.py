"""One checkpoint argument everywhere: `serve` and `convert-checkpoint` take a run
directory (its newest weights/vN), RUN/weights/vN and RUN/checkpoints/step-N as `eval
--checkpoint` does (areal_cli.rundir.checkpoints), on a real run's folder."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, run_areal
from tests.e2e.test_train import _args, _run_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _served_path(model: Path, log: Path) -> tuple[str, str]:
    """Start `areal serve MODEL`, return the model_path and weight_version it reports,
    stop it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_cli.cli", "serve", str(model), "--port", str(port),
         "--log", str(log)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/model_info", timeout=2) as r:
                    info = json.loads(r.read())
                    return info["model_path"], info["weight_version"]
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "serve did not come up"
                time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_serve_and_convert_take_a_run_directory_and_its_entries(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = subprocess.run(
        _args(runs, 2, "saver.freq_steps=1"), cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    run_dir = _run_dir(runs)
    newest = max((run_dir / "weights").iterdir(), key=lambda p: int(p.name[1:]))
    # served under the version it holds, as the run's servers label it
    assert _served_path(run_dir, tmp_path / "a.log") == (str(newest), newest.name[1:])
    checkpoint = next((run_dir / "checkpoints").iterdir())
    step = checkpoint.name.removeprefix("step-")
    assert _served_path(checkpoint, tmp_path / "b.log") == (str(checkpoint), step)

    converted = run_areal("convert-checkpoint", str(run_dir), str(tmp_path / "dcp"), "--verify")
    assert converted.returncode == 0, converted.stderr
    assert f"is a run directory: converting its newest weights, {newest}" in converted.stdout
    assert (tmp_path / "dcp" / "dcp" / ".metadata").is_file()
    stray = run_areal("convert-checkpoint", str(run_dir / "logs"), str(tmp_path / "x"))
    assert stray.returncode == 2 and "is not a checkpoint; give an HF folder" in stray.stderr
    assert "Traceback" not in stray.stderr and not (tmp_path / "x").exists()
