"""Two `areal train` runs started at the same moment, with the default ports (0: free ones
picked at launch), both finish, and each trains only on its own servers' samples.

Before free ports, both planned server-0 on 30000 and the trainer on 29500: one run's
server lost the bind, and its controller trained on the other run's server. Now each run
picks its own ports, its servers serve the run's own name (launch.plan.served_name), and
the controller checks that name before it sends anything.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli.launch.plan import served_name
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _start(fileroot: Path, trial: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_cli.cli",
            "train",
            "recipes/tiny_cpu.yaml",
            f"cluster.fileroot={fileroot}",
            f"trial_name={trial}",
            "total_train_steps=4",
            "logging.display=plain",
            "rollout.batch_size=4",
            "rollout.group_size=2",
        ],  # fmt: skip
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_runs_started_together_each_use_only_their_own_servers(tmp_path: Path) -> None:
    runs = {trial: _start(tmp_path, trial) for trial in ("a", "b")}
    outputs = {trial: proc.communicate(timeout=400) for trial, proc in runs.items()}
    for trial, proc in runs.items():
        assert proc.returncode == 0, outputs[trial][0][-2000:] + outputs[trial][1][-2000:]
    ports, names = {}, {}
    for trial in runs:
        run_dir = tmp_path / "tiny-cpu" / trial
        plan = json.loads((run_dir / "plan.json").read_text())
        record = json.loads((run_dir / "run.json").read_text())
        assert plan["run_id"] == record["run_id"] and record["state"] == "finished"
        server = next(p for p in plan["processes"] if p["name"] == "server-0")
        ports[trial], names[trial] = server["ports"][0], served_name(plan["run_id"])
        log = (run_dir / "logs" / "server-0.log").read_text()
        # the server that answered was this run's: it served this run's name on its port
        assert f"as '{names[trial]}' on http://127.0.0.1:{ports[trial]}" in log
        # and it loaded this run's weights only, every version the trainer published
        loaded = re.findall(r"weights swapped to (\S+)/v(\d+) ", log)
        assert {folder for folder, _ in loaded} == {str(run_dir / "weights")}
        versions = sorted(int(v) for _, v in loaded)  # v4 too, when it came before the end
        assert versions in ([1, 2, 3], [1, 2, 3, 4])
        metrics = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        assert [m["step"] for m in metrics] == [1, 2, 3, 4]
        assert metrics[0]["reward_mean"] < 0.7  # the start model's samples, not the other's
    assert ports["a"] != ports["b"] and names["a"] != names["b"]
