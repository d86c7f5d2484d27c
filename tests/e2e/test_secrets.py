"""The inference API key of a real run stays out of every command line (`ps`) and out of
every file of the run directory: servers read it from their environment, and plan.json
and config.yaml show it redacted."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_train import _args, _assert_no_processes_left, _run_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "s3cr3t-key-8c1f2a"


def _command_lines() -> list[str]:
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
    return lines


def test_the_api_key_is_in_no_command_line_and_no_file(tmp_path: Path) -> None:
    args = _args(tmp_path, 2, f"inference.api_key={KEY}")
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[str] = []
    while proc.poll() is None:
        seen += [line for line in _command_lines() if KEY in line and "pytest" not in line]
        time.sleep(0.2)
    out = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 0, out[-3000:]
    # the controller's own argv holds it (the user typed it there); no child's does
    children = [line for line in seen if "areal_cli.cli" not in line]
    assert children == [], children[:2]
    run_dir = _run_dir(tmp_path)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert files and not [p for p in files if KEY.encode() in p.read_bytes()]
    assert "<redacted>" in (run_dir / "config.yaml").read_text()
    _assert_no_processes_left(run_dir)
