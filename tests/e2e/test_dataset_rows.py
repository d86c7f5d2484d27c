"""Bad dataset rows in real runs: `areal train` skips them with one warning line per kind
and trains on the rest; `areal eval` under on_bad_row: error stops before any server."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_eval import _eval
from tests.e2e.test_train import _args, _assert_no_processes_left, _metrics, _run_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BAD = [
    b'{"prompt": "1+1=", "answer": "\xff"}',
    b'{"prompt": "1+1=", "answer":',
    b'{"answer": "2"}',
    b'{"prompt": 12, "answer": "2"}',
    b'{"prompt": "1+1="}',
    b'{"prompt": "1+1=", "answer": [2]}',
    json.dumps({"prompt": "1+1=" * 400, "answer": "2"}).encode(),  # over 1024 tokens
]


def _data_with_bad_rows(tmp_path: Path) -> tuple[Path, int]:
    good = (REPO / "recipes" / "data" / "arith_train.jsonl").read_bytes().splitlines()[:40]
    lines = good[:20] + BAD + good[20:]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, len(good)


def test_train_skips_bad_rows_with_a_warning_per_kind(tmp_path: Path) -> None:
    data, n_good = _data_with_bad_rows(tmp_path)
    done = subprocess.run(
        _args(tmp_path, 1, f"dataset.path={data}"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warnings = [
        line
        for line in done.stderr.splitlines()
        if line.startswith("warning: ") and "mixed.jsonl" in line
    ]
    assert len(warnings) == len(BAD), done.stderr  # seven kinds, one row each
    for n in range(21, 21 + len(BAD)):
        assert sum(f"(line {n})" in line for line in warnings) == 1, (n, warnings)
    run_dir = _run_dir(tmp_path)
    log = (run_dir / "logs" / "controller.log").read_text()
    assert all(w in log for w in warnings)
    assert f"training ({n_good} prompts)" in log
    assert [r["step"] for r in _metrics(run_dir)] == [1]
    _assert_no_processes_left(run_dir)


def test_eval_stops_on_a_bad_row_before_any_server(tmp_path: Path) -> None:
    data, _ = _data_with_bad_rows(tmp_path)
    out = tmp_path / "out"
    done = _eval(tmp_path, out, f"eval.dataset.path={data}", "eval.dataset.on_bad_row=error")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "mixed.jsonl has 7 bad rows" in errors[0], done.stderr
    assert "eval.dataset.on_bad_row: skip" in errors[0]
    assert "Traceback" not in done.stderr and not out.exists()
